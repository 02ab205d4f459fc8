"""``eval.fidelity`` with the ``rotate_qk="smooth_hadamard"`` stand-in hooks installed (``qk_smooth_hooks``):
same arguments, e.g. ``--presets int8:rotate_qk=smooth_hadamard,int8:rotate_qk=hadamard``."""

from __future__ import annotations

import sys

from eval import fidelity
from eval.experiments import qk_smooth_hooks


def main(argv=None):
    qk_smooth_hooks.install()
    orig = fidelity.prepare

    def prepare(model, impl):
        cfg = impl.turbo_config
        qk_smooth_hooks.set_mode(getattr(cfg, "rotate_qk", "none") if cfg is not None else "none")
        return orig(model, impl)

    fidelity.prepare = prepare
    return fidelity.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
