"""TurboConfig: how turbo_int8 quantizes attention and the KV cache, with YAML presets.

Presets live in ``configs/*.yaml`` (installed as ``turbo_attn_hf.configs``):
  int8   every KV head stored as INT8 blocks (no INT4/INT2 packing)
  int4   every KV head stored as INT4 blocks
  mixed  the TurboAttention paper's setting: block 64, half of each layer's KV heads INT2, the rest
         INT4, SAS softmax

Per-head bit widths come either from ``n_2bit_heads`` (which heads: chosen per layer from the first
prefill's K/V by the calibration rule, ``head_select: prompt``, or the last heads, ``head_select: last``) or
from an explicit ``head_bits`` map
``[[bits of kv head 0, 1, ...] for each layer]`` written by ``turbo_attn_hf.calibrate``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from pathlib import Path
from typing import Optional

import yaml

SUPPORTED_BITS = (2, 4, 8)
SOFTMAX_MODES = ("exact", "sas")
HEAD_SELECT_MODES = ("prompt", "last")
ROTATE_QK_MODES = ("auto", "none", "hadamard", "smooth_hadamard")  # kernels/rotation.py ROTATIONS + "auto"
#: model types whose attention normalises Q and K per head (q/k-norm): the families with Q/K outlier channels that
#: per-token INT8 loses (issue 23: Gemma-3-270M int8 decode KL 22.8x the bf16 floor unrotated, 2.9x with
#: smooth_hadamard); ``rotate_qk: auto`` rotates these and leaves the others (SmolLM2's decode KL 2.4x -> 2.8x)
QK_NORM_MODEL_TYPES = ("gemma3", "gemma3_text", "qwen3", "qwen3_moe", "qwen3_next", "olmo2", "olmo3", "olmoe")
K_SCALE_RANGES = ("channel", "rope_pair")
PREFILL_ATTENTION_MODES = ("auto", "int8", "exact")
PACKED_K_BITS_MODES = ("auto", "head", 8)
#: ``prefill_attention: auto`` by CUDA compute capability (major): the path measured fastest there. sm_90: the INT8
#: prefill (Gluon kernel and quantization passes) runs at 0.67-1.02x cuDNN's bf16 attention, <= 0.95x below 16k keys
#: (issue 20, PERF_NOTES session 48), so the exact path wins below ``PREFILL_INT8_FROM_KEYS``; GPUs not listed (not
#: measured) keep the INT8 kernel
PREFILL_ATTENTION_BY_CAPABILITY = {9: "exact"}
#: ``auto`` on (compute capability major, head_dim): from this many keys a plain prompt (no mask, no softcap, exact
#: softmax) takes the INT8 prefill where the Gluon kernel runs it. Through generate() on an H200 (Llama-3-8B shape, 32
#: layers, int4) the TTFT was 0.945 / 0.933x sdpa's (exact / INT8) at 16k and 0.963 / 0.932x at 32k, a tie at 8k
#: (eval/results/ttft_prefill_path_32l_s46_h200.json; 0.934x at 32k with session 47's kernel,
#: eval/results/ttft_auto_32k_s47_h200.json). Head_dim 256 (the Gluon kernel on 16-bit V, session 48; 16 layers of
#: that hidden size in heads of 256): exact / INT8 0.948 / 0.952x at 8k, 0.965 / 0.959x at 16k, 0.953 / 0.921x at 32k
#: (eval/results/ttft_prefill_path_d256_16l_s48_h200.json). Head_dim 64 stays exact (0.64-0.91x cuDNN)
PREFILL_INT8_FROM_KEYS = {(9, 128): 16384, (9, 256): 16384}


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
        block_size: tokens per packed block (power of two, 16..256).
        sink_blocks: the first ``sink_blocks`` blocks of a sequence stay INT8 and are never packed: the
            attention-sink tokens at its start draw a large share of every row's attention, so their
            quantization error reaches every output (StreamingLLM's sinks; IntactKV keeps them lossless).
        recent_blocks: the latest ``recent_blocks`` full blocks (plus the partial tail) stay INT8 before
            they are packed (KIVI's full-precision residual window): recent tokens carry most of the
            attention of the next ones. With both 0 the cache is the plain TurboAttention layout.
        softmax: ``"exact"`` (exp2) or ``"sas"`` (TurboAttention sparse activated softmax).
        sas_threshold: SAS drops scores more than this many natural-log units below the row max.
        smooth_k: subtract the per-channel mean of K (fixed at prefill) before quantizing; the softmax
            output is unchanged, outliers shrink (SageAttention). Ignored with logit softcapping.
        head_select: which heads of a layer get 2 bits when no ``head_bits`` map is given: ``"prompt"``
            (default) applies the calibration rule (``calibrate.py``: lowest gap × std of K and V) to the
            first prefill's K/V of each layer, per cache; ``"last"`` takes the last heads.
        scale_headroom: the cache's fixed per-channel INT8 scale is ``headroom * amax(prefill) / 127``; later
            tokens beyond the prefill's range clamp. ``"auto"`` (default) sets it from the first prefill's
            length n (``cache.auto_headroom``: sqrt(ln 32768 / ln n) clamped to [1.25, 2]): a short prompt
            under-estimates the range of later tokens, a long one does not. A number fixes it.
        k_scale_range: what K's universal scale of a channel covers. ``"channel"``: ``amax|k - mean|`` of the
            channel over the first prefill. ``"rope_pair"``: for channels RoPE rotates (rotate_half pairs
            ``(j, j + r/2)``, r from the model config: ``partial_rotary_factor``), the max norm of the pair
            ``sqrt(k_j² + k_{j+r/2}²)`` and no K mean: RoPE turns a pair by a position-dependent angle, so a
            short prompt under-states a slowly turning channel's later range and mean (issue 21, PERF_NOTES
            "Long context"); it keeps the norm. Other channels, models whose RoPE layout is not known to be
            rotate_half, caches built without a model config and ``rotate_qk`` other than ``"none"`` use
            ``"channel"`` (``cache.rope_dims``).
        rotate_qk: ``"auto"`` (default): ``"smooth_hadamard"`` for q/k-norm model families
            (``QK_NORM_MODEL_TYPES``, from the model config; :func:`resolve_rotate_qk`), ``"none"`` otherwise, and
            ``"none"`` with ``k_scale_range: rope_pair`` (measured unrotated) or without a model config.
            ``"none"`` or ``"hadamard"``: rotate Q and K of every head by an orthonormal Hadamard
            matrix before INT8 (``kernels/rotation.py``; block-diagonal 16/32 for head_dim 80/96). Q·Kᵀ is
            unchanged, channel outliers are spread before per-token quantization (issue 23). The cache
            stores rotated K and rotates each query that reads it. ``"smooth_hadamard"``: first K -> Q scale
            migration per channel (``s_c = sqrt(max|K_c|)`` of the first store's keys, fixed for the cache's life;
            SmoothAttention), then the rotation: ``q·diag(s)·H``, ``k·diag(1/s)·H`` (eval/PERF_NOTES.md, issue 23).
        prefill_attention: the attention of a prompt over its own K/V (the first prefill; calls without a
            TurboCache). ``"int8"``: the INT8 flash-attention prefill (FlashQ / INT-FlashAttention, Triton).
            ``"exact"``: PyTorch's scaled_dot_product_attention in the model dtype (cuDNN / flash on a GPU), as a
            vLLM FP8 KV cache prefills: the cache is quantized all the same, decode reads it as before.
            ``"auto"`` (default): the path measured fastest on the GPU (``PREFILL_ATTENTION_BY_CAPABILITY``:
            exact on sm_90, where the INT8 prefill is 0.67-1.02x cuDNN, but INT8 for plain prompts of 16k keys and
            more at head_dim 128 and 256, where it is the faster path through generate(): ``PREFILL_INT8_FROM_KEYS``;
            INT8 elsewhere and on CPU) and INT8 with logit softcapping (SDPA has none). :func:`prefill_attention_path`.
        packed_k_bits: K's width in packed (2/4-bit) blocks. ``"head"``: K packed to the head's bits, as V. ``8``:
            K blocks keep their INT8 codes and only V is packed (6 bits an element for a 4-bit head: 0.379x bf16 at
            head_dim 128 instead of 0.262x). ``"auto"`` (default): 8 for q/k-norm families (``QK_NORM_MODEL_TYPES``),
            whose K outlier channels 4 bits cannot hold (Gemma-3-270M int4 decode KL 5.49x -> 3.49x the bf16 floor on
            CPU; 2.98x on an H200: eval/PERF_NOTES.md sessions 28-29), ``"head"`` otherwise. :func:`resolve_rotate_qk`
            decides it.
        name: preset name, for logs and result tables.
    """

    bits: int = 8
    n_2bit_heads: int = 0
    frac_2bit_heads: float = 0.0
    head_bits: Optional[list[list[int]]] = None
    block_size: int = 64
    sink_blocks: int = 1
    recent_blocks: int = 2
    head_select: str = "prompt"
    softmax: str = "exact"
    sas_threshold: float = 6.0
    smooth_k: bool = True
    scale_headroom: float | str = "auto"
    k_scale_range: str = "channel"
    rotate_qk: str = "auto"
    prefill_attention: str = "auto"
    packed_k_bits: int | str = "auto"
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
        if self.scale_headroom != "auto" and not (
            isinstance(self.scale_headroom, (int, float)) and self.scale_headroom >= 1.0
        ):
            raise TurboConfigError(f"scale_headroom={self.scale_headroom!r} must be 'auto' or a number >= 1.0")
        if self.k_scale_range not in K_SCALE_RANGES:
            raise TurboConfigError(f"k_scale_range={self.k_scale_range!r} must be one of {K_SCALE_RANGES}")
        if self.rotate_qk not in ROTATE_QK_MODES:
            raise TurboConfigError(f"rotate_qk={self.rotate_qk!r} must be one of {ROTATE_QK_MODES}")
        if self.prefill_attention not in PREFILL_ATTENTION_MODES:
            raise TurboConfigError(
                f"prefill_attention={self.prefill_attention!r} must be one of {PREFILL_ATTENTION_MODES}")
        if self.packed_k_bits not in PACKED_K_BITS_MODES:
            raise TurboConfigError(f"packed_k_bits={self.packed_k_bits!r} must be one of {PACKED_K_BITS_MODES}")
        if self.head_select not in HEAD_SELECT_MODES:
            raise TurboConfigError(f"head_select={self.head_select!r} must be one of {HEAD_SELECT_MODES}")
        for name in ("sink_blocks", "recent_blocks"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 16:
                raise TurboConfigError(f"{name}={n!r} must be an integer between 0 and 16")
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

    def layer_head_bits(self, layer_idx: int, n_layers: int, n_kv_heads: int,
                        shard: tuple[int, int] = (0, 1)) -> list[int]:
        """Bits of each KV head of one layer; checks an explicit map against the model's shape.

        ``shard = (rank, world)``: the layer's KV heads are split over ``world`` tensor-parallel ranks and this
        one holds ``n_kv_heads`` of the ``n_kv_heads * world`` (a contiguous slice, as transformers shards
        them): an explicit map is sliced; a computed one spreads the layer's 2-bit heads over the ranks."""
        rank, world = shard
        total = n_kv_heads * world
        if self.head_bits is not None:
            if len(self.head_bits) != n_layers:
                raise TurboConfigError(
                    f"head_bits has {len(self.head_bits)} layers but the model has {n_layers}"
                )
            row = list(self.head_bits[layer_idx])
            if len(row) != total:
                raise TurboConfigError(
                    f"head_bits[{layer_idx}] has {len(row)} heads but the model has {total} KV heads"
                )
            return row[rank * n_kv_heads:(rank + 1) * n_kv_heads]
        n_2 = self.n_2bit_heads or int(self.frac_2bit_heads * total)
        if n_2 > total:
            raise TurboConfigError(
                f"n_2bit_heads={n_2} exceeds the model's {total} KV heads per layer"
            )
        n_2 = n_2 // world + (rank < n_2 % world)  # this rank's share, the shares summing to the layer's
        return [self.bits] * (n_kv_heads - n_2) + [2] * n_2

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
        """Load a config file; every problem with it is a TurboConfigError naming the file and the fix."""
        try:
            with open(path) as f:
                d = yaml.safe_load(f)
        except FileNotFoundError:
            raise TurboConfigError(
                f"config file {str(path)!r} does not exist; pass a preset name "
                f"({', '.join(sorted(available_presets()))}) or the path of a YAML file"
            ) from None
        except OSError as e:
            raise TurboConfigError(f"cannot read config file {str(path)!r}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise TurboConfigError(
                f"config file {str(path)!r} is not valid YAML{at}: {problem}; fix the syntax "
                "(it must be a mapping such as `bits: 4`)"
            ) from None
        d = {} if d is None else d
        if not isinstance(d, dict):
            raise TurboConfigError(
                f"config file {str(path)!r} holds a {type(d).__name__}, not a mapping of TurboConfig fields; "
                "write one `key: value` per line (e.g. `bits: 4`), as in configs/int4.yaml"
            )
        d.setdefault("name", Path(path).stem)
        try:
            return cls.from_dict(d)
        except TurboConfigError as e:
            raise TurboConfigError(f"config file {str(path)!r}: {e}") from None
        except TypeError as e:  # a value of the wrong type that validate() compared (e.g. a list for bits)
            raise TurboConfigError(f"config file {str(path)!r}: {e}") from None

    def to_yaml(self, path: str | Path) -> None:
        with open(path, "w") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False, default_flow_style=None)

    @classmethod
    def from_spec(cls, spec: str) -> "TurboConfig":
        """A preset name / YAML path with field overrides for ablations and benchmarks: ``int4:packed_k_bits=8`` or
        ``int4:sink_blocks=0,recent_blocks=0`` (values parsed as YAML). A bad override is a TurboConfigError."""
        name, _, over = spec.partition(":")
        cfg = cls.preset(name)
        if not over:
            return cfg
        kw = {}
        for item in over.split(","):
            key, eq, value = item.partition("=")
            if not eq:
                raise TurboConfigError(f"override {item!r} in {spec!r} is not key=value; e.g. int4:packed_k_bits=8")
            kw[key.strip()] = yaml.safe_load(value)
        return cls.from_dict({**cfg.to_dict(), **kw})

    @classmethod
    def preset(cls, name: str) -> "TurboConfig":
        """Load a preset by name (``int8``, ``int4``, ``mixed``) or a path to a YAML file."""
        if name.endswith((".yaml", ".yml")) or Path(name).is_file():
            return cls.from_yaml(name)
        avail = available_presets()
        if name not in avail:
            raise TurboConfigError(f"unknown preset {name!r}; available: {sorted(avail)} or a YAML path")
        return cls.from_yaml(avail[name])


def shared_config(spec: "str | dict") -> TurboConfig:
    """The TurboConfig of a preset name, YAML path or settings dict, one object per distinct settings: for configs
    the library builds on a caller's behalf (a cache's ``TurboCache("int4")``, a model's ``config.turbo_attn``), so
    the memos keyed by the config object (layer formats, cache templates, the resolved ``rotate_qk``) hit across
    caches and preset switches, and a packaged preset's YAML is parsed once (~0.8 ms a parse on the CPU box). Treat
    it as read-only: it is shared. ``TurboConfig.preset`` / ``from_dict`` still make a new object."""
    if isinstance(spec, dict):
        return _shared(spec)
    hit = _SHARED_PRESETS.get(spec)
    if hit is not None:
        return hit
    cfg = TurboConfig.preset(spec)
    out = _shared(cfg.to_dict(), cfg)
    if not (spec.endswith((".yaml", ".yml")) or Path(spec).is_file()):  # a YAML path is read every time: it may change
        _SHARED_PRESETS[spec] = out
    return out


def _shared(d: dict, built: Optional[TurboConfig] = None) -> TurboConfig:
    key = json.dumps(d, sort_keys=True, default=repr)
    cfg = _SHARED.get(key)
    if cfg is None:
        if len(_SHARED) >= 64:
            _SHARED.clear()
            _SHARED_PRESETS.clear()  # its objects must stay the ones _SHARED hands out
        cfg = _SHARED[key] = built if built is not None else TurboConfig.from_dict(dict(d))
    return cfg


_SHARED: dict = {}  # settings JSON -> TurboConfig
_SHARED_PRESETS: dict = {}  # packaged preset name -> TurboConfig


def available_presets() -> dict[str, Path]:
    """Preset name -> YAML path, from the installed ``turbo_attn_hf.configs`` package."""
    root = resources.files("turbo_attn_hf.configs")
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def resolve_rotate_qk(cfg: TurboConfig, model_config=None) -> TurboConfig:
    """``cfg`` with ``rotate_qk: auto`` and ``packed_k_bits: auto`` decided for a model (a copy; a config with neither
    is returned as it is): ``smooth_hadamard`` when the model type is a q/k-norm family and its head dim has a
    Hadamard block, unless ``k_scale_range`` is ``rope_pair``; else ``none``. ``packed_k_bits``: 8 for a q/k-norm
    family, else ``head``. Logged once per decision. The copy is kept per (config,
    model config) object pair: every cache of a model then holds the same resolved object, which keys the layers'
    memoised formats (``TurboLayer._layer_format``; a new copy per generate() missed that memo every prompt)."""
    if cfg.rotate_qk != "auto" and cfg.packed_k_bits != "auto":
        return cfg
    hit = _RESOLVED.get((id(cfg), id(model_config)))
    if hit is not None and hit[0] is cfg and hit[1] is model_config:
        return hit[2]
    out = _resolve_rotate_qk(cfg, model_config)
    if len(_RESOLVED) >= 64:
        _RESOLVED.clear()
    _RESOLVED[(id(cfg), id(model_config))] = (cfg, model_config, out)
    return out


#: resolve_rotate_qk's copies by the ids of (config, model config), with both objects (checked by identity)
_RESOLVED: dict = {}


def _resolve_rotate_qk(cfg: TurboConfig, model_config=None) -> TurboConfig:
    """``resolve_rotate_qk`` without the memo."""
    text = model_config
    if text is not None and hasattr(text, "get_text_config"):
        text = text.get_text_config(decoder=True)
    mtype = getattr(text, "model_type", None)
    k_bits = cfg.packed_k_bits
    if k_bits == "auto":
        k_bits = 8 if mtype in QK_NORM_MODEL_TYPES else "head"
        if k_bits == 8 and cfg.bits != 8:
            from .capabilities import log_once

            log_once(f"packed_k_bits:{mtype}", f"turbo_int8: packed_k_bits='auto' -> 8 for model_type {mtype!r} "
                     "(q/k-norm family: K blocks keep INT8, V packed); set packed_k_bits='head' to pack K too",
                     level=20)
    if cfg.rotate_qk != "auto":
        return dataclasses.replace(cfg, packed_k_bits=k_bits)
    mode = "none"
    if mtype in QK_NORM_MODEL_TYPES and cfg.k_scale_range != "rope_pair":
        from .kernels.rotation import RotationError, rotation_block

        heads = getattr(text, "num_attention_heads", 0) or 1
        d = getattr(text, "head_dim", None) or getattr(text, "hidden_size", 0) // heads
        try:
            rotation_block(int(d))
            mode = "smooth_hadamard"
        except (RotationError, TypeError, ValueError):
            mode = "none"
    if mode != "none":
        from .capabilities import log_once

        log_once(f"rotate_qk:{mtype}", f"turbo_int8: rotate_qk='auto' -> {mode!r} for model_type {mtype!r} (q/k-norm "
                                       "family: Q/K outlier channels); set rotate_qk='none' to turn it off",
                 level=20)
    return dataclasses.replace(cfg, rotate_qk=mode, packed_k_bits=k_bits)


@functools.lru_cache(maxsize=16)
def _capability_major(device: "torch.device") -> int:
    import torch

    return torch.cuda.get_device_capability(device)[0]


#: ``auto`` keeps the INT8 kernel where the exact path would build a mask of more elements than this (padding or a
#: sliding window: SDPA takes a bool ``[b, 1, Lq, Lk]``, and GQA's K/V repeated per query head): 8 x 32k padded
#: prompts would need 8 GiB for the mask alone, where the INT8 kernel masks in registers
EXACT_MASK_LIMIT = 1 << 28


def prefill_attention_path(cfg: TurboConfig, device: "torch.device", softcap: Optional[float] = None,
                           mask_elems: int = 0, *, keys: int = 0, head_dim: int = 0,
                           dtype: Optional["torch.dtype"] = None) -> str:
    """``"int8"`` or ``"exact"``: how a prompt attends over its own K/V on ``device`` (``TurboConfig.prefill_attention``;
    ``auto`` from ``PREFILL_ATTENTION_BY_CAPABILITY``; INT8 with a softcap, off CUDA, or where the exact path's mask
    would hold more than ``EXACT_MASK_LIMIT`` elements: ``mask_elems``, 0 for a plain causal prompt; INT8 for a plain
    prompt of at least ``PREFILL_INT8_FROM_KEYS`` ``keys`` at its ``head_dim`` where the Gluon kernel runs it, with
    the prompt's V ``dtype``: head_dim 256 runs there only on 16-bit V)."""
    mode = cfg.prefill_attention
    if mode != "auto":
        return mode
    if softcap or device.type != "cuda" or mask_elems > EXACT_MASK_LIMIT:
        return "int8"
    major = _capability_major(device)
    from_keys = PREFILL_INT8_FROM_KEYS.get((major, head_dim))
    if (from_keys is not None and keys >= from_keys and not mask_elems
            and _gluon_prefill_runs(device, head_dim, cfg, dtype)):
        return "int8"
    return PREFILL_ATTENTION_BY_CAPABILITY.get(major, "int8")


def _gluon_prefill_runs(device: "torch.device", head_dim: int, cfg: TurboConfig,
                        dtype: Optional["torch.dtype"] = None) -> bool:
    """The INT8 prefill of a plain prompt would run the Gluon kernel (``prefill.gluon_runs``: the kernel choice, the
    Triton release, the GPU, the softmax; ``dtype``: V's, whose 16-bit types P.V runs on); the portable kernel is
    slower than SDPA on sm_90 at every length."""
    from .kernels import prefill

    half = dtype in prefill.prefill_hopper.PV_HALF_DTYPES
    return prefill.gluon_runs(device, head_dim, softmax=cfg.softmax, pv_half=half)