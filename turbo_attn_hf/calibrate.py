"""Head-wise mixed precision calibration (TurboAttention §3.2): which KV heads get 2 bits.

Per layer and KV head h, over the calibration tokens, for K and for V:

    gap_c(h)    = max_t x[t, c] - min_t x[t, c]       per channel c, within each block of B tokens
                  (the range that one channel-wise asymmetric INT4/INT2 block quantizes), averaged over blocks
    priority(h) = mean_c gap_c(h) × std_c gap_c(h)    "gap × std": wide ranges that differ a lot between
                                                       channels lose the most when squeezed into 2 bits

K and V priorities are each divided by their mean over the layer's heads and added, so both count
equally (K ranges are typically much larger than V's). Per layer the ``n`` heads with the lowest
priority are stored in 2 bits, the rest in the base config's ``bits``. ``n`` comes from the base config
(``n_2bit_heads``, else ``floor(frac_2bit_heads × n_kv_heads)``; the ``mixed`` preset uses half).

Choices where the paper is terse (written down here so they can be revisited): the gap is taken per
block of ``block_size`` tokens (what the cache actually quantizes; K's per-channel mean smoothing does
not change a max−min gap), the channel gaps are averaged over blocks before ``mean × std``, and K and V
are pooled as above because one head map serves both.

K/V are read after RoPE from a ``DynamicCache`` filled by a forward over each prompt (batch 1, no
padding), which sees exactly the tensors the attention layer stores, for any architecture.

    cfg = calibrate(model, prompts, tokenizer=tok, base="mixed")   # -> TurboConfig with head_bits
    write_config(cfg, "configs/smollm2_mixed.yaml", header="calibrated on 64 GSM8K prompts")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import torch

from .config import TurboConfig, TurboConfigError
from .generation import cache_arg


@dataclass
class ChannelGaps:
    """Per-channel max−min of K and V, averaged over blocks: ``k``, ``v``: ``[n_layers, n_kv_heads, d]``."""

    k: torch.Tensor
    v: torch.Tensor
    n_blocks: int
    n_tokens: int


def _block_gaps(x: torch.Tensor, block: int) -> torch.Tensor:
    """x: ``[Hk, T, d]`` -> sum over blocks of the per-channel max−min ``[Hk, d]`` (fp32), and #blocks.

    Full blocks only; a sequence shorter than one block counts as one block."""
    Hk, T, d = x.shape
    nb = T // block
    if nb == 0:
        xb = x.float()[:, None]
        nb = 1
    else:
        xb = x[:, : nb * block].float().reshape(Hk, nb, block, d)
    gap = xb.amax(2) - xb.amin(2)  # [Hk, nb, d]
    return gap.sum(1), nb


@torch.no_grad()
def kv_channel_gaps(
    model, prompts: Iterable[Union[torch.Tensor, Sequence[int]]], *, block_size: int = 64, progress: bool = False
) -> ChannelGaps:
    """Run ``model`` over each prompt (token ids, batch 1) and accumulate per-block channel gaps of K/V.

    The model is switched to sdpa for the pass when it runs turbo_int8 (the calibration must see the
    unquantized K/V of every layer), and switched back afterwards.
    """
    from transformers import DynamicCache

    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    dev = next(model.parameters()).device
    impl = model.config._attn_implementation
    switched = impl not in ("sdpa", "eager")
    if switched:
        model.set_attn_implementation("sdpa")
    k_sum = v_sum = None
    n_blocks = n_tokens = 0
    it = prompts
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(list(prompts), desc="calibrate", unit="prompt")
    try:
        for ids in it:
            ids = torch.as_tensor(ids, dtype=torch.long, device=dev).reshape(1, -1)
            cache = DynamicCache(config=model.config)
            model(ids, **cache_arg(cache), use_cache=True)
            ks, vs, nb = [], [], None
            for layer in cache.layers:
                k, v = layer.keys[0], layer.values[0]  # [Hk, T, d]
                gk, nb_l = _block_gaps(k, block_size)
                gv, _ = _block_gaps(v, block_size)
                ks.append(gk)
                vs.append(gv)
                nb = nb_l if nb is None else nb
            ks, vs = torch.stack(ks), torch.stack(vs)
            k_sum = ks if k_sum is None else k_sum + ks
            v_sum = vs if v_sum is None else v_sum + vs
            n_blocks += nb
            n_tokens += ids.shape[1]
    finally:
        if switched:
            model.set_attn_implementation(impl)
    if k_sum is None:
        raise ValueError("calibration needs at least one prompt")
    return ChannelGaps(k=(k_sum / n_blocks).cpu(), v=(v_sum / n_blocks).cpu(), n_blocks=n_blocks, n_tokens=n_tokens)


def head_priority(gaps: ChannelGaps, use: str = "kv") -> torch.Tensor:
    """``[n_layers, n_kv_heads]`` priority = mean_c gap × std_c gap (``use``: ``k``, ``v`` or ``kv``)."""
    if use not in ("k", "v", "kv"):
        raise ValueError(f"use={use!r} must be 'k', 'v' or 'kv'")

    def prio(g: torch.Tensor) -> torch.Tensor:
        p = g.mean(-1) * g.std(-1, unbiased=False)  # [L, H]
        return p / p.mean(-1, keepdim=True).clamp_min(1e-30)

    if use == "k":
        return prio(gaps.k)
    if use == "v":
        return prio(gaps.v)
    return prio(gaps.k) + prio(gaps.v)


def prompt_head_priority(k: torch.Tensor, v: torch.Tensor, block_size: int, use: str = "kv") -> torch.Tensor:
    """``[n_kv_heads]`` priority of one layer from the K/V ``[b, Hk, T, d]`` of one prefill (batch rows pooled):
    the calibration rule applied to the prompt itself (``head_select: prompt``, used by TurboCache)."""
    b, H, T, d = k.shape
    gk, nb = _block_gaps(k.reshape(b * H, T, d), block_size)  # rows (batch, head): sums over their blocks
    gv, _ = _block_gaps(v.reshape(b * H, T, d), block_size)
    n = b * nb
    gaps = ChannelGaps(k=(gk.view(b, H, d).sum(0) / n)[None], v=(gv.view(b, H, d).sum(0) / n)[None], n_blocks=n,
                       n_tokens=b * T)
    return head_priority(gaps, use)[0]


def assign_head_bits(priority: torch.Tensor, n_2bit: int, bits: int = 4) -> list[list[int]]:
    """Per layer, the ``n_2bit`` lowest-priority heads -> 2 bits, the others -> ``bits``."""
    L, H = priority.shape
    if not 0 <= n_2bit <= H:
        raise TurboConfigError(f"n_2bit_heads={n_2bit} must lie in [0, {H}] (the model's KV heads per layer)")
    out = []
    for row in priority:
        low = set(torch.argsort(row, stable=True)[:n_2bit].tolist())
        out.append([2 if h in low else bits for h in range(H)])
    return out


def calibrate(
    model, prompts: Iterable[Union[str, torch.Tensor, Sequence[int]]], *, tokenizer=None,
    base: Union[str, TurboConfig] = "mixed", n_2bit_heads: Optional[int] = None, block_size: Optional[int] = None,
    use: str = "kv", name: Optional[str] = None, progress: bool = False,
) -> TurboConfig:
    """A copy of the ``base`` config with a calibrated ``head_bits`` map (see the module docstring).

    Args:
        prompts: strings (needs ``tokenizer``) or token-id sequences; a few dozen prompts of a few
            hundred tokens are plenty.
        base: preset name / YAML path / TurboConfig giving bits, block size, softmax, 2-bit fraction.
        n_2bit_heads: 2-bit heads per layer (default: from ``base``).
        block_size: tokens per gap block (default: ``base.block_size``).
    """
    cfg = base if isinstance(base, TurboConfig) else TurboConfig.preset(base)
    ids = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("calibrate() got text prompts but no tokenizer; pass tokenizer= or token ids")
            p = tokenizer(p).input_ids
        ids.append(p)
    gaps = kv_channel_gaps(model, ids, block_size=block_size or cfg.block_size, progress=progress)
    prio = head_priority(gaps, use)
    H = prio.shape[1]
    n2 = n_2bit_heads if n_2bit_heads is not None else (cfg.n_2bit_heads or int(cfg.frac_2bit_heads * H))
    if n2 == 0:
        raise TurboConfigError(
            f"base config {cfg.name!r} stores no head in 2 bits (n_2bit_heads=0, frac_2bit_heads="
            f"{cfg.frac_2bit_heads}); pass n_2bit_heads= or use base='mixed'"
        )
    d = cfg.to_dict()
    d.update(head_bits=assign_head_bits(prio, n2, cfg.bits), n_2bit_heads=n2, name=name or f"{cfg.name}_calibrated")
    out = TurboConfig.from_dict(d)
    out.priority = prio  # not a config field: kept on the object for reports (not serialised)
    out.calibration = {"n_prompts": len(ids), "n_tokens": gaps.n_tokens, "n_blocks": gaps.n_blocks, "use": use}
    return out


def write_config(cfg: TurboConfig, path: Union[str, Path], header: str = "") -> Path:
    """Write ``cfg`` as YAML with a comment header (calibration source, per-layer priorities)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# {ln}" for ln in header.splitlines() if ln.strip()]
    prio = getattr(cfg, "priority", None)
    if prio is not None:
        lines.append("# head priority (gap x std, K and V each normalised to mean 1 per layer), per layer:")
        lines += [f"#   {i:3d}: " + " ".join(f"{x:.3f}" for x in row.tolist()) for i, row in enumerate(prio)]
    tmp = path.with_suffix(path.suffix + ".tmp")
    cfg.to_yaml(tmp)
    path.write_text("\n".join(lines) + ("\n" if lines else "") + tmp.read_text())
    tmp.unlink()
    return path
