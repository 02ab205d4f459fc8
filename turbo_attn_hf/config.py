"""TurboConfig: how turbo_int8 quantizes attention and the KV cache, with YAML presets.

Presets live in ``configs/*.yaml`` (installed as ``turbo_attn_hf.configs``):
  int8   every KV head stored as INT8 blocks (no INT4/INT2 packing)
  int4   every KV head stored as INT4 blocks
  mixed  the TurboAttention paper's setting: block 64, half of each layer's KV heads INT2, the rest
         INT4, SAS softmax

Per-head bit widths come either from ``n_2bit_heads`` (which heads: the calibrated ``head_bits`` map
if present, otherwise the last heads of each layer) or from an explicit ``head_bits`` map
``[[bits of kv head 0, 1, ...] for each layer]`` written by ``turbo_attn_hf.calibrate``.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Optional

import yaml

SUPPORTED_BITS = (2, 4, 8)
SOFTMAX_MODES = ("exact", "sas")


class TurboConfigError(ValueError):
    """A TurboConfig value is out of range; the message names the field, the value and the limit."""


@dataclasses.dataclass
class TurboConfig:
    """Quantization settings of turbo_int8 (prefill kernel and TurboCache).

    Args:
        bits: storage bits of full KV blocks for heads not chosen as 2-bit (8 or 4; 2 allowed).
        n_2bit_heads: per layer, how many KV heads are stored in 2 bits (0 = none).
        frac_2bit_heads: alternatively the fraction of each layer's KV heads stored in 2 bits
            (floor(frac * n_kv_heads); the paper's "mixed" uses 0.5). Used when n_2bit_heads is 0.
        head_bits: optional explicit map ``[n_layers][n_kv_heads]`` of 2/4/8; overrides ``bits`` and
            ``n_2bit_heads``. Written by calibration.
        block_size: tokens per packed block and capacity of the INT8 tail buffer (power of two, 16..256).
        softmax: ``"exact"`` (exp2) or ``"sas"`` (TurboAttention sparse activated softmax).
        sas_threshold: SAS drops scores more than this many natural-log units below the row max.
        smooth_k: subtract the per-channel mean of K (fixed at prefill) before quantizing; the softmax
            output is unchanged, outliers shrink (SageAttention). Ignored with logit softcapping.
        scale_headroom: the cache's fixed per-channel INT8 scale is ``headroom * amax(prefill) / 127``; later
            tokens beyond the prefill's range clamp. 2.0 measured best on short prompts (mean per-step logit
            error of a 100-token int8 generate 0.60 at 1.0 vs 0.105 at 2.0; see tests/turbo_attn_hf/test_cache.py).
        name: preset name, for logs and result tables.
    """

    bits: int = 8
    n_2bit_heads: int = 0
    frac_2bit_heads: float = 0.0
    head_bits: Optional[list[list[int]]] = None
    block_size: int = 64
    softmax: str = "exact"
    sas_threshold: float = 6.0
    smooth_k: bool = True
    scale_headroom: float = 2.0
    name: str = "custom"

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise TurboConfigError(f"bits={self.bits!r} is not supported; choose one of {SUPPORTED_BITS}")
        bs = self.block_size
        if not isinstance(bs, int) or bs < 16 or bs > 256 or bs & (bs - 1):
            raise TurboConfigError(f"block_size={bs!r} must be a power of two between 16 and 256")
        if self.softmax not in SOFTMAX_MODES:
            raise TurboConfigError(f"softmax={self.softmax!r} must be one of {SOFTMAX_MODES}")
        if not (self.scale_headroom >= 1.0):
            raise TurboConfigError(f"scale_headroom={self.scale_headroom!r} must be >= 1.0")
        if not (self.sas_threshold > 0):
            raise TurboConfigError(f"sas_threshold={self.sas_threshold!r} must be > 0")
        if not isinstance(self.n_2bit_heads, int) or self.n_2bit_heads < 0:
            raise TurboConfigError(f"n_2bit_heads={self.n_2bit_heads!r} must be an integer >= 0")
        if not (0.0 <= self.frac_2bit_heads <= 1.0):
            raise TurboConfigError(f"frac_2bit_heads={self.frac_2bit_heads!r} must lie in [0, 1]")
        if self.head_bits is not None:
            if not isinstance(self.head_bits, (list, tuple)) or not all(
                isinstance(row, (list, tuple)) for row in self.head_bits
            ):
                raise TurboConfigError("head_bits must be a list (one per layer) of lists (one per KV head)")
            for i, row in enumerate(self.head_bits):
                bad = [b for b in row if b not in SUPPORTED_BITS]
                if bad:
                    raise TurboConfigError(
                        f"head_bits[{i}] contains {bad}; every entry must be one of {SUPPORTED_BITS}"
                    )

    def layer_head_bits(self, layer_idx: int, n_layers: int, n_kv_heads: int) -> list[int]:
        """Bits of each KV head of one layer; checks an explicit map against the model's shape."""
        if self.head_bits is not None:
            if len(self.head_bits) != n_layers:
                raise TurboConfigError(
                    f"head_bits has {len(self.head_bits)} layers but the model has {n_layers}"
                )
            row = list(self.head_bits[layer_idx])
            if len(row) != n_kv_heads:
                raise TurboConfigError(
                    f"head_bits[{layer_idx}] has {len(row)} heads but the model has {n_kv_heads} KV heads"
                )
            return row
        n_2 = self.n_2bit_heads or int(self.frac_2bit_heads * n_kv_heads)
        if n_2 > n_kv_heads:
            raise TurboConfigError(
                f"n_2bit_heads={n_2} exceeds the model's {n_kv_heads} KV heads per layer"
            )
        n_hi = n_kv_heads - n_2
        return [self.bits] * n_hi + [2] * n_2

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TurboConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise TurboConfigError(f"unknown TurboConfig keys {sorted(unknown)}; known: {sorted(fields)}")
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "TurboConfig":
        with open(path) as f:
            d = yaml.safe_load(f) or {}
        d.setdefault("name", Path(path).stem)
        return cls.from_dict(d)

    def to_yaml(self, path: str | Path) -> None:
        with open(path, "w") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False, default_flow_style=None)

    @classmethod
    def preset(cls, name: str) -> "TurboConfig":
        """Load a preset by name (``int8``, ``int4``, ``mixed``) or a path to a YAML file."""
        if name.endswith((".yaml", ".yml")) or Path(name).is_file():
            return cls.from_yaml(name)
        avail = available_presets()
        if name not in avail:
            raise TurboConfigError(f"unknown preset {name!r}; available: {sorted(avail)} or a YAML path")
        return cls.from_yaml(avail[name])


def available_presets() -> dict[str, Path]:
    """Preset name -> YAML path, from the installed ``turbo_attn_hf.configs`` package."""
    root = resources.files("turbo_attn_hf.configs")
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}
