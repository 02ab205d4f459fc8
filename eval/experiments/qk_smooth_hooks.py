"""Measurement-only stand-in for the ``rotate_qk="smooth_hadamard"`` hooks in ``turbo_attn_hf/cache.py`` and
``turbo_attn_hf/attention.py`` (issue 23), so the fidelity harness can run the mode before those files carry it.
What it does is exactly the proposed change (see eval/PERF_NOTES.md, issue 23):

* ``TurboLayer.update``: at the layer's first store, ``s = rotation.smooth_scales(K)``; every stored K is
  ``rotation.rotate(K, s, "k")`` (before the scales / mean / blocks are computed);
* ``TurboLayer.attention``: the query is ``rotation.rotate(q, s, "q")``;
* the attention function without a TurboCache: ``rotation.rotate_qk_pair(q, k, mode)``.

    from eval.experiments import qk_smooth_hooks; qk_smooth_hooks.install()
"""

from __future__ import annotations

_STATE = {"mode": "none", "installed": False}


def set_mode(mode: str) -> None:
    _STATE["mode"] = mode


def qk_scales(q, k):
    """SmoothAttention's factors from both ranges: ``s_c = sqrt(max|K_c - mean_c| / max|Q_c|)`` (Q's max over the
    KV head's query group), geometric mean 1 per (batch, KV head)."""
    import torch

    g = q.shape[1] // k.shape[1]
    kf = k.float()
    ka = (kf - kf.mean(2, keepdim=True)).abs().amax(2).clamp_min(2.0 ** -16)
    qa = q.float().abs().amax(2).view(q.shape[0], k.shape[1], g, -1).amax(2).clamp_min(2.0 ** -16)
    s = (ka / qa).sqrt()
    return (s / s.log().mean(-1, keepdim=True).exp()).clamp(2.0 ** -8, 2.0 ** 8)


def install() -> None:
    if _STATE["installed"]:
        return
    from turbo_attn_hf import attention as A
    from turbo_attn_hf import cache as C
    from turbo_attn_hf import config as CFG
    from turbo_attn_hf.kernels import rotation as RT

    if "smooth_hadamard" not in CFG.ROTATE_QK_MODES:  # the proposed config line
        CFG.ROTATE_QK_MODES = (*CFG.ROTATE_QK_MODES, "smooth_hadamard")
    # measurement-only variant, no-cache path only: SmoothAttention factors from both ranges, sqrt(max|K_c|/max|Q_c|)
    CFG.ROTATE_QK_MODES = (*CFG.ROTATE_QK_MODES, "smooth_hadamard_qk")

    L = C.TurboLayer
    orig_update, orig_attention, orig_clear, orig_prefill_fn = L.update, L.attention, L._clear, A._prefill_fn

    def smoothed(self):
        return getattr(self.turbo_config, "rotate_qk", "none") == "smooth_hadamard"

    def _clear(self):
        orig_clear(self)
        self.qk_smooth = None

    def update(self, key_states, value_states, *args, **kwargs):
        if smoothed(self):
            if getattr(self, "k_scale", None) is None and key_states.shape[2] > 0:
                self.qk_smooth = RT.smooth_scales(key_states)
            if getattr(self, "qk_smooth", None) is not None:
                key_states = RT.rotate(key_states, self.qk_smooth, "k")
        return orig_update(self, key_states, value_states, *args, **kwargs)

    def attention(self, query, key, value, **kw):
        if smoothed(self):
            query = RT.rotate(query, self.qk_smooth, "q")
        return orig_attention(self, query, key, value, **kw)

    def prefill_fn(device, model):
        fn = orig_prefill_fn(device, model)
        if _STATE["mode"] not in ("smooth_hadamard", "smooth_hadamard_qk"):
            return fn

        def wrapped(q, k, v, **kw):
            if _STATE["mode"] == "smooth_hadamard_qk":
                s = qk_scales(q, k)
                q, k = RT.rotate(q, s, "q"), RT.rotate(k, s, "k")
            else:
                q, k = RT.rotate_qk_pair(q, k, "smooth_hadamard")
            return fn(q, k, v, **kw)

        return wrapped

    L.update, L.attention, L._clear, A._prefill_fn = update, attention, _clear, prefill_fn
    _STATE["installed"] = True
