"""The command line shared by the experiments that run ``eval.fidelity`` with a reference twin patched:
``python -m eval.experiments.X --OPTION a,b -- <eval.fidelity arguments>``."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional


def run(argv: Optional[list], description: str, option: str, help: str, install: Callable[[list], None]):
    """Parse ``--option a,b`` before ``--``, ``install([a, b])`` (the patch), then ``eval.fidelity.main`` on the
    rest."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument(option, default="", help=help)
    args = ap.parse_args(argv[:cut])
    install([t for t in getattr(args, option.lstrip("-").replace("-", "_")).split(",") if t])
    from eval import fidelity

    return fidelity.main(argv[cut + 1:])
