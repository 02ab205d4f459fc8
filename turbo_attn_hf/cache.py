"""TurboCache: a Hugging Face ``Cache`` whose KV lives as an INT8 tail + head-wise INT4/INT2 packed blocks.

TurboAttention (Kang et al., 2024) §3.1-3.3 as storage (format in ``turbo_attn_hf.kernels.pack``):

* first prefill of a layer: per (batch row, KV head, channel) fp32 "universal" scales are fixed —
  ``s_k = h · amax|k - μ| / 127`` with μ the channel mean of the prompt's keys (``smooth_k``),
  ``s_v = h · amax|v| / 127``, headroom ``h`` from the prompt length (``auto_headroom``: a short prompt
  under-estimates the range of later tokens, which would clamp; measurements next to the constant);
  ``k_scale_range: rope_pair``: K channels RoPE rotates take ``h · max‖(k_j, k_{j+r/2})‖ / 127`` and μ = 0
  instead (the pair's norm survives the rotation, its range and mean do not: issue 21, ``rope_dims``);
* every token (prompt and later) is quantized to INT8 with those scales (outliers clamp to ±127);
* full blocks of ``block_size`` tokens are re-quantized (K per channel, V per token) to INT4/INT2 (integer
  scale/zero) into the buffer of their head's bit width (``TurboConfig.layer_head_bits``: a per-layer head
  permutation) — except the first ``sink_blocks`` blocks (attention sinks) and the latest
  ``recent_blocks`` full blocks + the partial tail, which stay in the INT8 buffer; when ``recent_blocks + 1``
  full blocks wait there, the oldest is packed. Nothing packed is ever re-quantized (``crop`` into a packed
  block is the one exception, see ``TurboLayer.crop``). Measured on SmolLM2-135M (int4, decode-path KL vs
  fp32, 3 GSM8K texts, CPU fake-quant): 20.2x the bf16 floor with neither, 9.3x with 2 recent blocks,
  3.0x with 1 sink block + 2 recent blocks.

``update()`` stores and returns key/value tensors that carry ``turbo_cache_layer`` (the layer): the real
new K/V at the first prefill (the INT8 prefill kernel runs on them), zero-memory placeholders of the right
shape afterwards. The attention function then calls ``layer.attention(...)``, which runs the decode kernel
(``kernels.decode.turbo_decode_attention``) over the packed blocks + tail. No bf16 copy of the cache exists.

``rotate_qk`` (issue 23; ``auto`` decided from the model config by ``config.resolve_rotate_qk``): the universal
scales, the INT8 buffer and the packed blocks all hold rotated K. The Triton stats / store kernels get raw K and
rotate it in their pass (``rotate=``, ``qk_smooth=``), the prefill and decode kernels get the unrotated query (and,
at the first prefill, raw K) and rotate them themselves; the PyTorch path rotates K with ``kernels.rotation.rotate``
before its store. Returned keys carry ``turbo_rotated``. Q·Kᵀ is unchanged; V is never rotated.

Left padding: the universal scales of a row include its padded prompt positions (update() does not see the
mask); the padded keys are masked in attention. Sliding-window layers keep all tokens (the window is applied
in attention), so their ``get_mask_sizes`` offset is 0.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from typing import Any, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from . import first_prefill
from .attention import exact_attention, exact_path_elems
from .config import TurboConfig, TurboConfigError, prefill_attention_path, resolve_rotate_qk, shared_config
from .kernels.arena import carve, lazy_view
from .kernels.device import on_tensor_device
from .kernels.interpreter import use_triton
from .kernels.pack import PackedKV, kv_bytes_per_token, quantize_int8
from .kernels.quant import check_qk_smooth, factor_arg
from .kernels.reference import k_smooth_mean, kv_finite_mean_ref, rope_pair_amax_ref, rotate_keys_ref
from .kernels.smooth_factors import smooth_factors

__all__ = ["TurboCache", "TurboCacheFullError", "TurboLayer", "TurboSlidingWindowLayer", "TurboStaticLayer",
           "TurboStaticSlidingWindowLayer"]

logger = logging.getLogger(__name__)

_BITS_ORDER = (8, 4, 2)
#: universal scale = headroom * amax / 127 of the first prefill: n prompt tokens under-estimate the range of a
#: context of N (the expected max grows like sqrt(2 ln n)), so h = sqrt(ln N / ln n), clamped; measurements in
#: PERF_NOTES "Universal-scale headroom".
AUTO_HEADROOM_CONTEXT = 32768
AUTO_HEADROOM_RANGE = (1.25, 2.0)
DEFAULT_SCALE_HEADROOM = "auto"
#: True: every store runs the Triton kernels of kernels/store.py: a decode step that packs no block is one
#: launch (instead of ~22 PyTorch launches), the first prefill 2 (stats + K mean, scales and head choice; store;
#: was ~60-110 with host syncs for mixed's head choice), a store that packs blocks 1-2. False = the PyTorch path
#: (kept to measure against: eval/bench_layer_step.py, eval/bench_store.py; CPU tensors without
#: TRITON_INTERPRET=1 always take it). Both store the same codes, scales and head choice (tests).
FUSED_STORE = True
#: True: an eager decode step's token (fused store, no block to pack; a rotated layer's K rotated there) is written by
#: the step's decode launch (``turbo_decode_attention(store=...)``): one launch per layer and step instead of two, and
#: the store's host path gone (issue 18's eager bar). Until that launch, the buffers are kept out of the layer's
#: ``__dict__`` and any other read of them stores the token first (``_settle``). False = the store's own launch in
#: ``update``.
DEFER_DECODE_STORE = True
#: with DEFER_DECODE_STORE, a rotated layer's token too (its K rotated by the decode launch, bit for bit as the store
#: kernel rotates it; session 32). False = its store's own launch, to measure the two against each other on the GPU.
DEFER_ROTATED_STORE = True
_DEFERRED = ("k_tail", "v_tail", "nonfinite")  # what a deferred store writes: read through _settle until it ran


def _finite_aminmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 min and max over dim 2 of the finite elements of ``x`` (+inf / -inf where none is finite)."""
    fin = torch.isfinite(x)
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    return torch.where(fin, x, inf).amin(dim=2).float(), torch.where(fin, x, -inf).amax(dim=2).float()


_HEAD_MAPS: dict = {}
_KERNEL_MODULES: dict = {}


def _kernels(name: str):
    """``turbo_attn_hf.kernels.<name>``, imported on first use (the per-step paths skip the import machinery of a
    function-level import; attributes are still looked up on the module, so patches of it apply)."""
    mod = _KERNEL_MODULES.get(name)
    if mod is None:
        import importlib

        mod = _KERNEL_MODULES[name] = importlib.import_module(f"{__package__}.kernels.{name}")
    return mod


def _head_map(heads: tuple, device) -> torch.Tensor:
    """A read-only int32 device tensor of ``heads``, made once per (heads, device): a layer's fixed head map
    then costs no host-to-device copy per layer and prefill."""
    key = (heads, device)
    t = _HEAD_MAPS.get(key)
    if t is None:
        t = _HEAD_MAPS[key] = torch.tensor(heads, dtype=torch.int32, device=device)
    return t


@functools.lru_cache(maxsize=256)
def _layer_specs(b: int, hk: int, d: int, cap: int, fused: bool, mean: bool, rotated_mean: bool, n2: int) -> tuple:
    """A layer's storage for ``arena.carve``: the INT8 buffer and, for the fused first store, what it writes (the
    non-finite counter, the scales, the K mean and its rotation, ``head_select: prompt``'s head maps with ``n2``
    2-bit heads)."""
    specs = (("k_tail", (b, hk, cap, d), torch.int8), ("v_tail", (b, hk, d, cap), torch.int8))
    if fused:
        f32 = torch.float32
        specs += (("nonfinite", (1,), torch.int32), ("k_scale", (b, hk, d), f32), ("v_scale", (b, hk, d), f32))
        if mean:
            specs += (("k_mean", (b, hk, d), f32),)
        if rotated_mean:
            specs += (("k_mean_rot", (b, hk, d), f32),)
        if n2:
            specs += (("heads_hi", (hk - n2,), torch.int32), ("heads_lo", (n2,), torch.int32))
    return specs


@functools.lru_cache(maxsize=256)
def _bit_groups(head_bits: tuple) -> tuple:
    """``((bits, heads of that width), ...)`` in ``_BITS_ORDER``, widths present only."""
    return tuple((bits, tuple(h for h, hb in enumerate(head_bits) if hb == bits)) for bits in _BITS_ORDER
                 if bits in head_bits)


def auto_headroom(n_tokens: int) -> float:
    """Headroom of the universal INT8 scale fixed from a first prefill of ``n_tokens`` tokens."""
    lo, hi = AUTO_HEADROOM_RANGE
    if n_tokens < 3:
        return hi
    return min(hi, max(lo, math.sqrt(math.log(AUTO_HEADROOM_CONTEXT) / math.log(n_tokens))))


def _resolve_config(turbo_config: TurboConfig | str | None, model_config: Any = None) -> TurboConfig:
    """The cache's TurboConfig, ``rotate_qk: auto`` decided for ``model_config`` (``config.resolve_rotate_qk``)."""
    return resolve_rotate_qk(_given_config(turbo_config, model_config), model_config)


def _given_config(turbo_config: TurboConfig | str | None, model_config: Any = None) -> TurboConfig:
    if isinstance(turbo_config, TurboConfig):
        return turbo_config
    if isinstance(turbo_config, str):
        return shared_config(turbo_config)
    if turbo_config is None:
        try:
            from .capabilities import get_turbo_config

            return get_turbo_config(model_config)
        except ImportError:  # pragma: no cover - glue not installed
            return shared_config("int4")
    if isinstance(turbo_config, dict):
        return shared_config(turbo_config)
    raise TurboConfigError(
        f"turbo_config must be a TurboConfig, a preset name or a YAML path, got {type(turbo_config).__name__}"
    )


def tp_shard(n_kv_heads: int, total: Optional[int]) -> tuple[int, int]:
    """``(rank, world)`` of a layer whose KV heads are split over tensor-parallel ranks (it sees ``n_kv_heads`` of
    the model's ``total``); ``(0, 1)`` when it sees them all or the total is unknown."""
    if total is None or n_kv_heads == total:
        return 0, 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1  # without a process group the layer's own head count is the model's (as before TP)
    if total % n_kv_heads:
        raise TurboConfigError(
            f"a TurboCache layer got {n_kv_heads} of the model's {total} KV heads: tensor parallelism must split "
            "the KV heads evenly over the ranks"
        )
    world = total // n_kv_heads
    return dist.get_rank() % world, world


#: model types whose attention applies HF's rotate_half RoPE to the first ``partial_rotary_factor · head_dim``
#: channels of K (pairs (j, j + r/2)); others (interleaved pairs, RoPE on trailing channels as in MLA, no RoPE)
#: keep per-channel K scales under ``k_scale_range: rope_pair``
ROTATE_HALF_MODEL_TYPES = frozenset((
    "llama", "mistral", "mixtral", "ministral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3", "gemma3_text", "phi", "phi3", "stablelm", "gpt_neox", "nemotron", "olmo", "olmo2", "olmo3", "olmoe",
    "granite", "granitemoe", "starcoder2", "smollm3"))
_ROPE_FALLBACK_LOGGED: set = set()


def rope_layout(config: Any, log: bool = False) -> tuple[int, Optional[list]]:
    """``(channels, no_rope_layers)``: how many leading K channels RoPE turns in rotate_half pairs on a layer that
    applies RoPE (0 when the layout is not known to be rotate_half, logged once per model type), and SmolLM3's
    per-layer ``no_rope_layers`` (1 = the layer applies RoPE) or None. The config is read once here: a transformers
    config's attribute access costs microseconds, ~25 us a layer when read per layer (the cache is built per
    generate())."""
    if config is None:
        return 0, None
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    mt = getattr(text_config, "model_type", None)
    rp = getattr(text_config, "rope_parameters", None) or {}
    if rp and all(isinstance(x, dict) for x in rp.values()):  # per layer type (Gemma-3): same layout in each
        rp = next(iter(rp.values()), {})
    if mt not in ROTATE_HALF_MODEL_TYPES:
        if log and mt not in _ROPE_FALLBACK_LOGGED:
            _ROPE_FALLBACK_LOGGED.add(mt)
            logger.info("turbo_int8: k_scale_range 'rope_pair' needs HF's rotate_half RoPE layout; model type %r is "
                        "not known to use it, so K keeps per-channel scales", mt)
        return 0, None
    hd = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    f = rp.get("partial_rotary_factor", getattr(text_config, "partial_rotary_factor", None)) or 1.0
    use = getattr(text_config, "no_rope_layers", None)
    return int(hd * f) // 2 * 2, None if use is None else list(use)


def rope_dims(config: Any, layer_idx: int, log: bool = False, layout: Optional[tuple] = None) -> int:
    """How many leading K channels of layer ``layer_idx`` RoPE turns in rotate_half pairs (``k_scale_range:
    rope_pair``), from the model's config (or its ``rope_layout``, read once for all layers); 0 (per-channel K
    scales) without a config, when the layout is not known to be rotate_half or the layer has no RoPE."""
    dims, use = layout if layout is not None else rope_layout(config, log)
    if use is not None and layer_idx < len(use) and not use[layer_idx]:
        return 0
    return dims


#: ``TurboLayer._layer_format``'s memo: (layer class, id(TurboConfig), position, shape facts) -> (config, bits, id)
_FORMATS: dict = {}
#: a layer format (the tuple ``_layer_format`` builds) -> its id; ids come from a counter, so a cleared memo
#: never gives an old plan's id to another format
_FORMAT_IDS: dict = {}
_NEXT_FORMAT_ID = itertools.count()


class TurboLayer(CacheLayerMixin):
    """One full-attention layer's quantized KV (INT8 tail + packed blocks per bit width).

    Args:
        turbo_config: the quantization settings.
        layer_idx: index of this layer in the model (selects its row of ``head_bits``).
        n_layers: number of layers of the model (checks an explicit ``head_bits`` map), or None.
    """

    is_sliding = False
    is_croppable = True
    #: the model's KV heads per layer (set by TurboCache from the model config): a layer that sees fewer is a
    #: tensor-parallel shard and takes its slice of the head map
    n_kv_heads_total: Optional[int] = None
    #: leading K channels RoPE turns in rotate_half pairs (set by TurboCache from the model config, ``rope_dims``);
    #: 0 = unknown: ``k_scale_range: rope_pair`` then keeps per-channel scales
    rope_dims: int = 0
    is_compileable = False
    #: the storage of a layer / of a bit group is views of one allocation each (``arena.carve``): ~4-8 us of host
    #: per ``torch.empty`` on the GPU machine, 12-19 of them a first prefill
    _one_buffer = True
    _cap_blocks = 0  # the static layer's preallocated blocks (a class default: no __getattr__ miss on the hot path)

    def __init__(self, turbo_config: TurboConfig, layer_idx: int = 0, n_layers: Optional[int] = None, **kwargs):
        super().__init__()
        self.turbo_config = turbo_config
        self.layer_idx = layer_idx
        self.n_layers = n_layers
        self.scale_headroom = getattr(turbo_config, "scale_headroom", DEFAULT_SCALE_HEADROOM)
        # fixed for the layer's life: stored K is in the rotated basis, so every query that reads it is rotated
        mode = getattr(turbo_config, "rotate_qk", "none")
        self.rotated = mode in ("hadamard", "smooth_hadamard")
        self.smoothed = mode == "smooth_hadamard"  # K -> Q factors fixed at the first store (qk_smooth)
        self._clear()

    def _clear(self) -> None:
        self.__dict__.pop("_lazy", None)  # views a replayed first prefill had not made yet
        self.__dict__.pop("_pend", None)  # a deferred token's store: dropped with everything else
        self.keys = self.values = None  # HF code that probes .keys finds no bf16 copy
        self.is_initialized = False
        self.groups: list[PackedKV] = []
        self._plan_bits: list[int] = []  # the config's per-head bits (provisional with head_select "prompt")
        self.k_tail = self.v_tail = None
        self._flat: Optional[torch.Tensor] = None  # the byte buffer of the layer's storage views (lazy_initialization)
        self._fresh: dict = {}  # views of it the fused first store writes (scales, counter, head maps)
        self.nonfinite: Optional[torch.Tensor] = None  # int32 [1]: stored token vectors with an inf/NaN
        self.n_tail = 0
        self.k_mean = self.k_scale = self.v_scale = None
        self.prefill_k_mean = None  # the first prefill's full K mean (its attention), where k_mean drops channels
        self.qk_smooth: Optional[torch.Tensor] = None  # smooth_hadamard: s [b, Hk, d], fixed at the first store
        self.headroom: Optional[float] = None  # the universal scales' headroom, fixed at the first prefill
        self._first_prefill = False
        self._decode_entry = None  # (call, decode entry) of the last decode launch (attention)
        self._token_shape = None  # a deferred decode token's shape: the next like it takes ``defer_token``

    # ------------------------------------------------------------------ set-up
    def _layer_head_bits(self, n_kv_heads: int) -> list[int]:
        cfg = self.turbo_config
        shard = tp_shard(n_kv_heads, self.n_kv_heads_total)
        if cfg.head_bits is not None:
            n_layers = self.n_layers if self.n_layers is not None else len(cfg.head_bits)
            if self.layer_idx >= len(cfg.head_bits):
                raise TurboConfigError(
                    f"head_bits has {len(cfg.head_bits)} layers but layer {self.layer_idx} was updated; "
                    "re-run turbo_attn_hf.calibrate for this model"
                )
            return cfg.layer_head_bits(self.layer_idx, n_layers, n_kv_heads, shard)
        return cfg.layer_head_bits(self.layer_idx, self.n_layers or self.layer_idx + 1, n_kv_heads, shard)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, hk, _, d = key_states.shape
        if tuple(value_states.shape[:2]) != (b, hk) or value_states.shape[-1] != d:
            raise ValueError(f"keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} disagree")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch, self.n_kv_heads, self.head_dim = b, hk, d
        bs = self.turbo_config.block_size
        self._plan_bits = self._layer_head_bits(hk)  # provisional with head_select "prompt" (first prefill decides)
        self.groups = []  # made by the first prefill's store, at the capacity it needs (none allocated twice)
        cap = (self.turbo_config.sink_blocks + self.turbo_config.recent_blocks + 1) * bs
        # no fill: slots at or past n_tail are never read (the decode kernel masks them; any int8 is finite)
        fused = self._fused(key_states)
        smooth = self.turbo_config.smooth_k
        specs = _layer_specs(b, hk, d, cap, fused, fused and smooth, fused and self.rotated and smooth,
                             self._plan_bits.count(2) if fused and self._prompt_select() else 0) + self._extra_specs()
        views = carve(specs, lambda name, shape, dtype: self._empty(self._storage_key(name), shape, dtype),
                      self._one_buffer)
        self._flat = views.pop("flat")
        self.k_tail, self.v_tail = views.pop("k_tail"), views.pop("v_tail")
        self._fresh = views
        self.n_tail = 0
        self.is_initialized = True

    def _extra_specs(self) -> tuple:
        """More ``(name, shape, dtype)`` of the layer's one storage allocation (left in ``_fresh``)."""
        return ()

    def _storage_key(self, name: str) -> tuple:
        """Where a tensor ``lazy_initialization`` makes lives once stored (``TurboStaticLayer._storage``)."""
        if name in ("heads_hi", "heads_lo"):  # the groups' head maps, in _make_groups' order
            order = [bits for bits in _BITS_ORDER if bits in (self.turbo_config.bits, 2)]
            return ("group", order.index(self.turbo_config.bits if name == "heads_hi" else 2), "heads")
        if name == "k_mean" and self.rotated:  # the raw mean (the prefill's); the stored one is k_mean_rot
            return ("layer", "prefill_k_mean")
        return ("layer", {"flat": "_flat", "k_mean_rot": "k_mean"}.get(name, name))

    def _empty(self, key: tuple, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A new storage tensor; ``key`` names it as :meth:`TurboStaticLayer._storage` does (the static layout
        hands back the kept tensor of that name and layout instead)."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _make_groups(self, head_bits: list[int], capacity: int = 1, maps: Optional[dict] = None,
                     one_buffer: Optional[bool] = None) -> None:
        """One empty PackedKV per bit width present in ``head_bits``; ``maps``: bits -> a device head map to use
        (written by the first prefill's head choice) instead of the list's; ``one_buffer``: each group's tensors
        views of one allocation (default: as the layer's)."""
        one_buffer = self._one_buffer if one_buffer is None else one_buffer
        self.groups = []
        for i, (bits, heads) in enumerate(_bit_groups(tuple(head_bits))):
            hm = maps[bits] if maps and bits in maps else _head_map(heads, self.device)
            self.groups.append(PackedKV.empty(
                bits, hm, self.batch, self.head_dim, self.turbo_config.block_size, self.device, capacity=capacity,
                alloc=lambda name, shape, dtype, i=i: self._empty(("group", i, name), shape, dtype),
                one_buffer=one_buffer, k_bits=self._k_bits(bits)))

    def _k_bits(self, bits: int) -> int:
        """K's width in a group of ``bits``-bit heads (``TurboConfig.packed_k_bits``: 8 keeps K's INT8 codes)."""
        return 8 if self.turbo_config.packed_k_bits == 8 else bits

    def _prompt_select(self) -> bool:
        """Whether the first prefill chooses this layer's 2-bit heads (``head_select: prompt``)."""
        cfg = self.turbo_config
        n2 = self._plan_bits.count(2)
        return cfg.head_bits is None and cfg.head_select == "prompt" and 0 < n2 < len(self._plan_bits)

    def _select_heads(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """``head_select: prompt`` (PyTorch path): the 2-bit heads of this layer are the lowest-priority ones
        (gap × std, ``calibrate.prompt_head_priority``) of the first prefill; the number of 2-bit heads is the
        config's. The fused path makes the same choice on the device (``store._finish_layer``)."""
        if not self._prompt_select():
            return
        from .calibrate import assign_head_bits, prompt_head_priority

        cfg = self.turbo_config
        prio = prompt_head_priority(key_states, value_states, cfg.block_size)
        self._make_groups(assign_head_bits(prio[None].cpu(), self._plan_bits.count(2), cfg.bits)[0])

    @property
    def head_bits(self) -> list[int]:
        """Bits of each KV head: a host view of the groups' device head maps (one sync when asked; the store
        path never reads it)."""
        if not self.groups:
            return list(self._plan_bits)
        out = [0] * self.n_kv_heads
        for grp in self.groups:
            for h in grp.heads.tolist():
                out[h] = grp.bits
        return out

    # ------------------------------------------------------------------ non-finite K/V
    def nonfinite_tokens(self) -> int:
        """Stored (batch row, KV head, token) vectors whose K or V held an inf/NaN (stored as code 0 and left out
        of the universal scales). One host sync."""
        return 0 if self.nonfinite is None or self.k_scale is None else int(self.nonfinite.item())

    def _count_nonfinite(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """PyTorch path: add the new vectors with an inf/NaN to the counter."""
        bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))
        self.nonfinite += bad.sum().to(torch.int32)

    # ------------------------------------------------------------------ storing
    @property
    def n_blocks(self) -> int:
        return self.groups[0].n_blocks if self.groups else 0

    def _append_blocks(self, k8: torch.Tensor, v8: torch.Tensor) -> None:
        """PyTorch path: full blocks of INT8 codes into each group."""
        head_bits = self.head_bits
        for grp in self.groups:
            heads = [h for h, hb in enumerate(head_bits) if hb == grp.bits]
            if heads == list(range(heads[0], heads[-1] + 1)):  # a range of heads (all of them, in int4/int8): a view
                sel = slice(heads[0], heads[-1] + 1)
                grp.append(k8[:, sel], v8[:, sel])
            else:
                idx = grp.heads.long()
                grp.append(k8.index_select(1, idx), v8.index_select(1, idx))

    @property
    def n_sink(self) -> int:
        """INT8 buffer slots reserved for the sequence's first tokens (never packed)."""
        return self.turbo_config.sink_blocks * self.turbo_config.block_size

    def _write_tail(self, slot: int, k8: torch.Tensor, v8: torch.Tensor) -> None:
        n = k8.shape[2]
        self.k_tail[:, :, slot:slot + n] = k8
        self.v_tail[:, :, :, slot:slot + n] = v8.transpose(-1, -2)

    def _fused(self, x: torch.Tensor) -> bool:
        return FUSED_STORE and use_triton(x.device)

    def _write_tokens(self, slot: int, key_states: torch.Tensor, value_states: torch.Tensor, count: bool = True
                      ) -> None:
        """Quantize ``[b, Hk, T, d]`` K/V to INT8 and write them to buffer slots ``slot ..``; ``count``: add their
        non-finite vectors to the counter (the first prefill's stats counted them already)."""
        if self._fused(key_states):
            _kernels("store").store_int8_tokens(key_states, value_states, self.k_scale, self.k_mean, self.v_scale,
                                                self.k_tail, self.v_tail, slot,
                                                nonfinite=self.nonfinite if count else None, **self._rot_kw)
        else:
            if count:
                self._count_nonfinite(key_states, value_states)
            self._write_tail(slot, quantize_int8(key_states, self.k_scale, self.k_mean),
                             quantize_int8(value_states, self.v_scale))

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor, first: bool = False) -> None:
        """Append tokens ``[b, Hk, T, d]`` (layout: ``reference.int8_buffer_layout``): the first ``n_sink``
        tokens of the sequence fill the sink slots, later ones the recent part of the INT8 buffer; whenever
        ``recent_blocks + 1`` full blocks wait there the oldest are packed. ``first``: the first prefill (its
        non-finite vectors were counted by the stats already)."""
        bs = self.turbo_config.block_size
        T = key_states.shape[2]
        keep = self.turbo_config.recent_blocks * bs
        if T == 0:
            return
        if not self._packs(T):  # no block to pack (the decode step's common case)
            self._write_tokens(self.n_tail, key_states, value_states, count=not first)
            self.n_tail += T
            return
        if self._fused(key_states):
            self._store_fused(key_states, value_states, first)
            return
        if not first:
            self._count_nonfinite(key_states, value_states)
        k8 = quantize_int8(key_states, self.k_scale, self.k_mean)
        v8 = quantize_int8(value_states, self.v_scale)
        take = max(min(self.n_sink - self.n_tail, T), 0)  # free sink slots
        if take:
            self._write_tail(self.n_tail, k8[:, :, :take], v8[:, :, :take])
            self.n_tail += take
            k8, v8 = k8[:, :, take:], v8[:, :, take:]
        s0 = self.n_sink
        c = self.n_tail - s0  # recent tokens waiting in the buffer; with k8 they fill >= one block past keep
        if c:  # the waiting tokens go first (one copy of <= (recent_blocks + 1)·bs tokens per packed block)
            k8 = torch.cat([self.k_tail[:, :, s0:s0 + c], k8], dim=2)
            v8 = torch.cat([self.v_tail[:, :, :, s0:s0 + c].transpose(-1, -2), v8], dim=2)
        n = k8.shape[2]
        n_pack = (n - keep) // bs * bs
        self._append_blocks(k8[:, :, :n_pack], v8[:, :, :n_pack])
        self._write_tail(s0, k8[:, :, n_pack:], v8[:, :, n_pack:])
        self.n_tail = s0 + n - n_pack

    def _store_fused(self, key_states: torch.Tensor, value_states: torch.Tensor, first: bool) -> None:
        """A store that packs blocks, in one Triton launch (two when recent tokens wait in the buffer):
        ``kernels.store.store_kv``. The plan (how many tokens go to the sinks, how many blocks) is host
        arithmetic on host ints: no sync."""
        from .kernels.store import store_kv

        bs = self.turbo_config.block_size
        T = key_states.shape[2]
        keep = self.turbo_config.recent_blocks * bs
        take = max(min(self.n_sink - self.n_tail, T), 0)  # free sink slots
        c = self.n_tail + take - self.n_sink  # recent tokens waiting in the buffer (>= 0: sinks are full)
        n = c + T - take
        n_pack = (n - keep) // bs * bs
        for grp in self.groups:
            grp.reserve(grp.n_blocks + n_pack // bs)
        store_kv(key_states, value_states, self.k_scale, self.k_mean, self.v_scale, self.k_tail, self.v_tail,
                 self.groups, take=take, slot_sink=self.n_tail, c=c, s0=self.n_sink, n_pack=n_pack,
                 nonfinite=None if first else self.nonfinite, **self._rot_kw)
        for grp in self.groups:
            grp.n_blocks += n_pack // bs
        self.n_tail = self.n_sink + n - n_pack

    def _rotate_keys(self, key_states: torch.Tensor) -> torch.Tensor:
        """K as the store takes it: raw where the Triton store kernels rotate it themselves (``_rot_kw``), else in
        the stored (rotated) basis as those kernels compute it (``reference.rotate_keys_ref``: fp32 butterfly, not
        rounded to K's dtype; the static step's store does the same, so both layouts store the same codes);
        smooth_hadamard's factors fixed by the first keys that arrive (:meth:`_fix_smooth_factors`)."""
        self._fix_smooth_factors(key_states)
        return key_states if self._fused(key_states) else rotate_keys_ref(key_states, self.qk_smooth)

    def _fix_smooth_factors(self, key_states: torch.Tensor) -> None:
        """smooth_hadamard: the K -> Q factors from the first keys that arrive, kept for the layer's life."""
        if self.smoothed and self.qk_smooth is None and key_states.shape[2] > 0:
            # one Triton pass over K where the kernels run (issue 23: the torch twin cost +120..361 % of the store)
            self.qk_smooth = smooth_factors(key_states, kernel=use_triton(key_states.device))

    @property
    def _rot_kw(self) -> dict:
        """The rotation arguments of the store, prefill and decode kernels: they rotate raw K / Q in their pass."""
        return dict(rotate=self.rotated, qk_smooth=self.qk_smooth) if self.rotated else {}

    def _check_keys(self, key: torch.Tensor) -> None:
        """``key`` must be what update() returned: a rotated layer's kernels rotate the query (and the first
        prefill's K) with the factors that layer fixed."""
        if not getattr(key, "turbo_rotated", False):
            raise ValueError(
                f"TurboCache layer {self.layer_idx} stores rotated K (rotate_qk={self.turbo_config.rotate_qk!r}); "
                "pass the keys its update() returned, not other key tensors"
            )

    def _k_rope_dims(self, d: int) -> int:
        """Of ``d`` K channels, how many take their RoPE pair's norm as range (``k_scale_range: rope_pair``); 0:
        none. A rotated K basis (``rotate_qk``) mixes the pairs: per-channel."""
        r = min(self.rope_dims, d)
        return r if self.turbo_config.k_scale_range == "rope_pair" and not self.rotated and r >= 2 else 0

    def _cache_k_mean(self, mean: Optional[torch.Tensor], rot: int) -> None:
        """Keep the first prefill's K mean for its attention; the stored K's mean is 0 on the ``rot`` pair-scaled
        channels (None when that is all of them)."""
        self.prefill_k_mean = mean
        if mean is not None and rot:
            mean = None if rot == mean.shape[-1] else torch.cat([torch.zeros_like(mean[..., :rot]), mean[..., rot:]],
                                                                 dim=-1)
        self.k_mean = mean

    def _first_store_fused(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The first prefill in 2 launches, no host sync: stats with the K mean, the scales and the head choice
        (``kernels.store.kv_stats``' launch), store (``store_kv``'s); the layer's storage is one allocation
        (``lazy_initialization``) and each bit group's one more (``arena.carve``). Bit for bit the PyTorch path's
        codes, scales and mean; the same head choice (priorities equal to fp32 rounding). Everything but the
        tensors comes from the shape's :class:`first_prefill.FirstStorePlan`, which the first layer of the shape
        builds (and records for the others to replay: ``_replay_first_prefill``)."""
        if key_states.stride(-1) != 1:
            key_states = key_states.contiguous()
        if value_states.stride(-1) != 1:
            value_states = value_states.contiguous()
        plan, build = self._first_store_plan(key_states, value_states)
        fresh, self._fresh = self._fresh, {}
        self.headroom = plan.headroom
        self.nonfinite = nonfinite = fresh["nonfinite"]
        mean, ks, vs, mrot = fresh.get("k_mean"), fresh["k_scale"], fresh["v_scale"], fresh.get("k_mean_rot")
        if plan.n2 is None:
            hi = lo = ks
            self._make_groups(self._plan_bits, capacity=plan.capacity)
        else:
            hi, lo = fresh["heads_hi"], fresh["heads_lo"]
            self._make_groups(self._plan_bits, capacity=plan.capacity, maps={self.turbo_config.bits: hi, 2: lo})
        factors = factor_arg(self.qk_smooth, ks)
        stats_args = plan.stats(key_states, value_states, mean, ks, vs, mrot, nonfinite, hi, lo, factors)
        self.k_scale, self.v_scale = ks, vs
        self._cache_k_mean(mean, plan.rot)
        if self.rotated:  # the stores subtract the mean in the stored basis; the prefill rotates the raw one
            self.k_mean = mrot
        if build:
            plan.store = self._first_store_kv(key_states, value_states, plan)
        if plan.store is None:  # no block to pack: the INT8 buffer alone (one launch)
            self._store(key_states, value_states, first=True)
            return
        store_args = plan.store(key_states, value_states, ks, self.k_mean, vs, self.k_tail, self.v_tail, None,
                                self.groups, self.qk_smooth)
        for grp in self.groups:
            grp.n_blocks = plan.n_blocks
        self.n_tail = plan.n_tail
        if build and self._one_buffer:  # the next layers of this shape replay it
            plan.replay = first_prefill.record(self, plan, key_states, value_states, stats_args, store_args)

    def _replay_first_prefill(self, key_states: torch.Tensor, value_states: torch.Tensor,
                              batch: Optional[first_prefill.Batch] = None) -> bool:
        """The first prefill of an uninitialised dynamic layer as a replay of the first store an earlier layer of the
        same format and K/V shape recorded (``first_prefill``): queued in ``batch`` (the cache's, launched with its
        other layers) where the prompt's attention will not read the cache (``prefill_attention`` exact), else the
        layer's and its groups' buffers and two relaunches now; their tensors become views on first use
        (``__getattr__``). A smooth_hadamard layer's factors are an input of the replay: queued, the flush makes them
        for all its queued layers in one launch (``qk_smooth`` then resolves with the views); else the layer makes
        its own first (one launch). False: no replay (the layer may have fixed its factors)."""
        ks, vs = key_states.shape, value_states.shape
        if not self._one_buffer or len(ks) != 4 or len(vs) != 4 or not self._fused(key_states):
            return False
        b, hk, T, d = ks
        if T == 0 or vs[0] != b or vs[1] != hk or vs[3] != d:
            return False
        plan = first_prefill.PLANS.get(self._first_store_key(key_states, value_states))
        rp = plan.replay if plan is not None else None
        if rp is None:
            return False
        queue = batch is not None and prefill_attention_path(self.turbo_config, key_states.device, keys=T,
                                                             head_dim=d, dtype=value_states.dtype) == "exact"
        pend = queue and self.smoothed and self.qk_smooth is None  # the flush makes this layer's factors
        if not pend:
            self._fix_smooth_factors(key_states)
        f = None if pend else first_prefill.factors_of(self, key_states)
        gen = batch.add(rp, key_states, value_states, f) if queue else None
        if gen is None and pend:  # not queued after all: the layer's own launch
            self._fix_smooth_factors(key_states)
            f, pend = first_prefill.factors_of(self, key_states), False
        if gen is not None:
            bufs, j = None, len(gen.items) - 1
        else:
            bufs = first_prefill.replay(rp, key_states, value_states, f)
            if bufs is None:
                return False
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch, self.n_kv_heads, self.head_dim = b, hk, d
        self.headroom, self.n_tail = plan.headroom, plan.n_tail
        d_ = self.__dict__
        for name in first_prefill.LAYER_VIEWS + (("qk_smooth",) if pend else ()):
            d_.pop(name, None)
        d_.pop("_flat", None)  # a view too (``Replay.layer_views``): queued, the buffers do not exist yet
        self._lazy = first_prefill.Queued(gen, j, None) if bufs is None else (bufs, rp.layer_views)
        groups = []
        for i, (bits, heads, views) in enumerate(rp.groups):
            g = PackedKV.__new__(PackedKV)
            g.bits, g.k_bits, g.n_blocks = bits, self._k_bits(bits), plan.n_blocks
            g._lazy = first_prefill.Queued(gen, j, i) if bufs is None else (bufs, views)
            if heads is not None:
                g.heads = heads
            groups.append(g)
        self.groups = groups
        self.is_initialized = True
        return True

    def __getattr__(self, name: str):
        if name in _DEFERRED and "_pend" in self.__dict__:
            self._settle()  # a deferred token is stored before anything else reads the buffers
            return self.__dict__[name]
        return lazy_view(self, name)  # a replayed first prefill's storage: its views on first use

    def _defer(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Count one decode token now and leave its store to the step's decode launch (``DEFER_DECODE_STORE``):
        the buffers leave ``__dict__`` with the token, so every other read of them stores it first."""
        # read through attributes first: a replayed first prefill's buffers are made on first use (``lazy_view``)
        bufs = (self.k_tail, self.v_tail, self.nonfinite)
        d = self.__dict__
        for name in _DEFERRED:
            del d[name]
        d["_pend"] = (key_states, value_states, *bufs, self.n_tail)
        self.n_tail += 1

    def defer_token(self, key_states: torch.Tensor, value_states: torch.Tensor) -> Optional[tuple]:
        """``update`` of a decode token shaped like the last deferred one (``_token_shape``) whose store the
        step's decode launch can take, or None (then ``update``): plain generate()'s steady step without
        ``update``'s first-prefill, shape and rotation checks, which a deferred token of this shape passed already
        (``_clear`` forgets the shape)."""
        if value_states.shape != key_states.shape or not self._defers(key_states):
            return None
        self._defer(key_states, value_states)
        self._first_prefill = False
        return self._placeholders(self.get_seq_length())

    def _pop_deferred(self) -> tuple:
        """The deferred token ``(k, v, its buffer slot)``, the buffers back in ``__dict__``."""
        d = self.__dict__
        k, v, d["k_tail"], d["v_tail"], d["nonfinite"], slot = d.pop("_pend")
        return k, v, slot

    def _settle(self) -> None:
        """Store a deferred token with the store's own launch (a read of the buffers came before the decode launch)."""
        k, v, slot = self._pop_deferred()
        self._write_tokens(slot, k, v)

    def _defers(self, key_states: torch.Tensor) -> bool:
        """Whether this decode token's store is left to the step's decode launch (``DEFER_DECODE_STORE``): one
        token, no block to pack, the Triton store path, nothing deferred already. A rotated layer's token is
        deferred raw: the decode launch rotates it as the store kernel would."""
        return (key_states.shape[2] == 1 and DEFER_DECODE_STORE and (DEFER_ROTATED_STORE or not self.rotated)
                and "_pend" not in self.__dict__ and not self._packs(1) and self._fused(key_states))

    def _packs(self, T: int) -> bool:
        """Appending ``T`` tokens fills the INT8 buffer's ``recent_blocks + 1`` blocks after the sinks (``_store``
        packs the oldest)."""
        cfg = self.turbo_config
        return self.n_tail + T >= self.n_sink + (cfg.recent_blocks + 1) * cfg.block_size

    def _first_store_key(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """What a fused first store depends on besides the tensors' addresses: the layer's format (``_layer_format``),
        K/V's layout. Sets ``_plan_bits``."""
        ks = key_states.shape
        bits, fmt = self._layer_format(ks[1], ks[3])
        self._plan_bits = list(bits)
        # smoothed: the layer has (or its queued store will have) factors, as every smooth_hadamard layer's first store
        return (fmt, self.smoothed, ks, key_states.stride(), value_states.shape, value_states.stride(),
                key_states.dtype, value_states.dtype, key_states.device)

    def _layer_format(self, hk: int, d: int) -> tuple:
        """``(head bits, format id)``: this layer's per-head bits for ``hk`` KV heads and an id of everything of its
        format a first store depends on — ids never reused, one per distinct format. Memoised per layer position and
        config object (a new cache per generate() makes new layers; a TurboConfig is not changed once in use), except
        for a tensor-parallel shard (its rank is read at each call)."""
        cfg = self.turbo_config
        memo = self.n_kv_heads_total in (None, hk)
        key = (type(self), id(cfg), self.layer_idx, self.n_layers, hk, d, self.rope_dims, self.scale_headroom,
               self._cap_blocks)
        hit = _FORMATS.get(key) if memo else None
        if hit is not None and hit[0] is cfg:
            return hit[1], hit[2]
        bits = tuple(self._layer_head_bits(hk))
        self._plan_bits = list(bits)  # _prompt_select reads it
        fmt = (type(self), bits, self._prompt_select(), cfg.bits, cfg.block_size, cfg.sink_blocks, cfg.recent_blocks,
               cfg.smooth_k, self._k_rope_dims(d), self.rotated, self.scale_headroom, self._cap_blocks, cfg.packed_k_bits)
        fid = _FORMAT_IDS.get(fmt)
        if fid is None:
            fid = _FORMAT_IDS[fmt] = next(_NEXT_FORMAT_ID)
        if memo:
            if len(_FORMATS) >= 4096:
                _FORMATS.clear()
            _FORMATS[key] = (cfg, bits, fid)
        return bits, fid

    def _first_store_plan(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """``(plan, new)``: the :class:`first_prefill.FirstStorePlan` of this layer's format and these K/V, new (its
        ``store`` still to make, once the groups exist) when no layer made it before."""
        key = self._first_store_key(key_states, value_states)
        plan = first_prefill.PLANS.get(key)
        if plan is not None:
            return plan, False
        from .kernels.store import stats_launch

        cfg = self.turbo_config
        check_qk_smooth(self.qk_smooth, self.rotated, key_states)
        T = key_states.shape[2]
        h = self.scale_headroom
        h = auto_headroom(T) if h == "auto" else float(h)
        bs = cfg.block_size
        n = T - min(self.n_sink, T)  # tokens after the sinks; the first prefill's blocks are reserved at once
        nb = (n - cfg.recent_blocks * bs) // bs if n >= (cfg.recent_blocks + 1) * bs else 0
        n2 = self._plan_bits.count(2) if self._prompt_select() else None
        rot = self._k_rope_dims(key_states.shape[-1])
        plan = first_prefill.FirstStorePlan(h, max(nb, 1), n2, rot, stats_launch(
            key_states, value_states, cfg.smooth_k, bs, h, n2, rot, self.rotated, self.qk_smooth is not None))
        if len(first_prefill.PLANS) >= 256:
            first_prefill.PLANS.clear()
        first_prefill.PLANS[key] = plan
        return plan, True

    def _first_store_kv(self, key_states: torch.Tensor, value_states: torch.Tensor,
                        plan: first_prefill.FirstStorePlan):
        """The plan's ``store_kv`` launch (checked as ``store_kv`` checks) and the lengths after it; None when the
        prompt fills no block to pack (``_store`` writes the INT8 buffer)."""
        from .kernels.store import check_store_kv, store_kv_launch

        bs = self.turbo_config.block_size
        T = key_states.shape[2]
        keep = self.turbo_config.recent_blocks * bs
        if T < self.n_sink + keep + bs:
            return None
        take = min(self.n_sink, T)  # sink slots; then c = 0: no recent token waits in an empty buffer
        n = T - take
        n_pack = (n - keep) // bs * bs
        C = self.k_tail.shape[2]
        check_store_kv(key_states, C, self.groups, take=take, slot_sink=0, c=0, s0=self.n_sink, n_pack=n_pack)
        plan.n_blocks, plan.n_tail = n_pack // bs, self.n_sink + n - n_pack
        return store_kv_launch(key_states, value_states, self.groups, take=take, slot_sink=0, c=0, s0=self.n_sink,
                               n_pack=n_pack, C=C, has_mean=self.k_mean is not None, count=False,
                               rotate=self.rotated, has_factor=self.qk_smooth is not None)

    def _fix_scales(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The universal scales (module doc) from the first prefill ``[b, Hk, T, d]``: three reads of K/V in
        their own dtype (K's mean and min/max, V's min/max), no fp32 copy of either; bit for bit the fp32
        formula ``reference.kv_universal_scales_ref`` (tests/turbo_attn_hf/test_cache.py). Non-finite elements
        are left out (``_finite_aminmax``, ``reference.kv_finite_mean_ref``) and counted. The PyTorch path; the
        fused one is ``_first_store_fused``."""
        h = self.scale_headroom
        h = auto_headroom(key_states.shape[2]) if h == "auto" else float(h)
        self.headroom = h
        self.nonfinite = torch.zeros(1, dtype=torch.int32, device=key_states.device)
        self._count_nonfinite(key_states, value_states)
        k_min, k_max = _finite_aminmax(key_states)
        rot = self._k_rope_dims(key_states.shape[-1])
        if self.turbo_config.smooth_k:
            # k_smooth_mean: an fp64 sum read from the 16-bit keys (no copy), exact, so the same bits as the fused
            # store's (which sums in its own order) and the prefill's; also the reference's mean
            mean = kv_finite_mean_ref(key_states, k_smooth_mean(key_states))
            # max_i |fl(k_i - mu)| = max(fl(k_max - mu), fl(mu - k_min)) exactly: fl(x - mu) is monotone in x
            # and round-to-nearest is symmetric (fl(-y) = -fl(y)), so the extreme differences come from the
            # extreme keys (a channel without a finite key: -inf, scale 1)
            k_amax = torch.maximum(k_max - mean, mean - k_min)
        else:
            mean = None
            k_amax = torch.maximum(k_max, -k_min)  # |k| max, exact in any dtype
        self._cache_k_mean(mean, rot)
        if rot:
            k_amax = torch.cat([rope_pair_amax_ref(key_states, rot), k_amax[..., rot:]], dim=-1)
        v_min, v_max = _finite_aminmax(value_states)
        v_amax = torch.maximum(v_max, -v_min)
        ks = k_amax * (h / 127.0)
        vs = v_amax * (h / 127.0)
        self.k_scale = torch.where(ks > 0, ks, torch.ones_like(ks))
        self.v_scale = torch.where(vs > 0, vs, torch.ones_like(vs))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: Optional[dict] = None,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new K/V ``[b, Hk, T, d]``; return tensors carrying ``turbo_cache_layer = self``: the given
        ones at the first prefill, else zero-memory placeholders ``[b, Hk, seq_len, d]``."""
        if not self.is_initialized:
            if self._replay_first_prefill(key_states, value_states):
                return self._first_prefill_keys(key_states, value_states)
            self.lazy_initialization(key_states, value_states)
        b, hk, T, d = key_states.shape
        if (b, hk, d) != (self.batch, self.n_kv_heads, self.head_dim):
            raise ValueError(
                f"TurboCache layer {self.layer_idx} holds [batch {self.batch}, {self.n_kv_heads} KV heads, "
                f"head_dim {self.head_dim}] but got key states {tuple(key_states.shape)}"
            )
        raw_keys = key_states  # what the first prefill's attention gets: its kernels rotate Q and K in their pass
        if self.rotated:  # everything stored holds rotated K (never the caller's K)
            key_states = self._rotate_keys(key_states)
        first = self.k_scale is None
        if first:
            if T == 0:
                return self._placeholders(0)
            if self._fused(key_states):
                self._first_store_fused(key_states, value_states)
            else:
                self._make_groups(self._plan_bits)
                self._fix_scales(key_states, value_states)
                if self.rotated:  # that mean is of rotated K; the prefill takes raw K and makes its own
                    self.prefill_k_mean = None
                self._select_heads(key_states, value_states)
                self._store(key_states, value_states, first=True)
        elif self._defers(key_states):
            self._defer(key_states, value_states)
            self._token_shape = key_states.shape
        else:
            self._store(key_states, value_states)
        self._first_prefill = first
        if first:
            return self._first_prefill_keys(raw_keys, value_states)
        return self._placeholders(self.get_seq_length())

    def _first_prefill_keys(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """The first prefill's own K (raw) / V, marked for the attention function. A dynamic layer's next decode
        token of this batch and head layout takes ``defer_token``: ``update``'s checks of it are this prefill's."""
        self._first_prefill = True
        if not self.is_compileable:  # a static layer never defers
            b, hk, _, d = key_states.shape
            self._token_shape = torch.Size((b, hk, 1, d))
        key_states.turbo_cache_layer = self
        value_states.turbo_cache_layer = self
        key_states.turbo_rotated = self.rotated
        return key_states, value_states

    def _placeholders(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # one tensor for keys and values: attention reads the layer, never these elements (per layer and step)
        k = placeholder_element(self.dtype, self.device).expand(self.batch, self.n_kv_heads, n, self.head_dim)
        k.turbo_cache_layer = self
        k.turbo_rotated = self.rotated
        return k, k

    # ------------------------------------------------------------------ attention
    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale=None,
                  causal: bool = True, window=None, softcap=None, key_valid=None) -> torch.Tensor:
        """Attention of ``query [b, Hq, Lq, d]`` over this layer's cache -> ``[b, Lq, Hq, d]`` (query dtype).

        The first prefill runs the INT8 flash-attention prefill on the given ``key``/``value``; every later
        call runs the decode kernel over the packed blocks + tail (causal within a multi-token chunk).
        A rotated layer (``rotate_qk``) hands its kernels the unrotated query (and, at the first prefill, the raw
        keys), which they rotate in their pass: pass the keys ``update()`` returned (they carry ``turbo_rotated``).
        """
        cfg = self.turbo_config
        if self.rotated:
            self._check_keys(key)
        if self._first_prefill and key.shape[2] == query.shape[2] and key.stride(-1) == 1:
            # the prompt's own K/V (raw K: not rotated)
            elems = exact_path_elems(cfg, query, key, causal=causal, window=window, softcap=softcap,
                                     key_valid=key_valid, device=self.device)
            if elems is not None:
                return exact_attention(query, key, value, scale=scale, causal=causal, window=window,
                                       softcap=softcap, key_valid=key_valid, mask_elems=elems)
            from .kernels import reference

            fn = reference.turbo_attention
            if use_triton(query.device):
                fn = _kernels("prefill").turbo_attention
            q, k, v = query, key, value
            if q.dtype not in (torch.bfloat16, torch.float16) and fn is not reference.turbo_attention:
                q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
            # k_mean: the store's mean of these keys (the same bits as k_smooth_mean), so K is reduced once per prefill
            out = fn(q, k, v, scale=scale, causal=causal, window=window, softcap=softcap, key_valid=key_valid,
                     softmax=cfg.softmax, sas_threshold=cfg.sas_threshold, smooth_k=cfg.smooth_k,
                     k_mean=self.prefill_k_mean, rotate_qk=self.rotated, qk_smooth=self.qk_smooth)
            return out.to(query.dtype)
        if use_triton(query.device):  # decode_inputs() spelled out: this runs per layer and decode step
            store = None
            pend = self.__dict__.get("_pend")
            # the deferred token, if this is its step's query and the launch can store it; else the reads below store
            # it first
            dec = _kernels("decode")
            if pend is not None and pend[5] == self.n_tail - 1 and \
                    dec.stores_in_launch(query.shape[2], query.shape[1], pend[0].shape[1]):
                k, v, _ = self._pop_deferred()
                store = (k, v, self.nonfinite)
            # the decode entry of this layer's last call, reused while the query layout, the options and the storage
            # objects are the same (the entry holds weak references: ``alive``) — skips the process-wide entry key
            stor = self._decode_stor(dec)
            call = (query.shape, query.stride(), query.dtype, query.get_device(), scale, causal, window, softcap,
                    key_valid is None, cfg)
            memo = self._decode_entry
            if memo is not None and memo[0] == call and memo[1].alive(stor):
                entry = memo[1]
            else:
                if memo is None:  # the layer's first decode call: the next cache's binds it ahead (prepare_decode)
                    _remember_decode_call(self.layer_idx, call)
                entry = self._bind_decode(dec, query, stor, call)
            # a step like the last: its launch replayed (None: not like it)
            out = entry.run_step(query, self.groups, stor, self.n_tail, key_valid, *(store or ()))
            if out is not None:
                return out
            return entry.run(query, self.groups, stor, self.n_tail, key_valid, store)
        args, kw = self.decode_inputs()
        kw.update(scale=scale, causal=causal, window=window, softcap=softcap, key_valid=key_valid, **self._rot_kw)
        from .kernels.reference import turbo_decode_ref

        return turbo_decode_ref(query, *args, **kw)

    def _decode_stor(self, dec: Any) -> tuple:
        """The layer's storage tensors in a decode entry's order (``decode.decode_storage``)."""
        return dec.decode_storage(self.k_tail, self.v_tail, self.k_scale, self.v_scale, self.k_mean,
                                  self.qk_smooth if self.rotated else None, self.groups)

    def _bind_decode(self, dec: Any, query: torch.Tensor, stor: tuple, call: tuple, rebind_only: bool = False):
        """The decode entry of ``call`` (``attention``'s key of a decode call: the query's layout and the options)
        over ``stor``, kept as the layer's memo; None with ``rebind_only`` where it would be a new entry."""
        scale, causal, window, softcap, no_key_valid, cfg = call[4:]
        entry = dec.decode_entry(query, self.groups, stor, no_key_valid, True, scale=scale, causal=causal,
                                 window=window, softcap=softcap, n_sink=cfg.sink_blocks * cfg.block_size,
                                 softmax=cfg.softmax, sas_threshold=cfg.sas_threshold, rotate=self.rotated,
                                 rebind_only=rebind_only)
        if entry is not None:
            self._decode_entry = (call, entry)
        return entry

    def prepare_decode(self, stand_ins: dict) -> None:
        """Make the storage views and bind the decode entry that this layer's first decode call will look up, as
        the same layer position of the last cache made its first one (``_DECODE_CALLS``): a new cache's first decode
        step otherwise pays both (~100 us a layer on the GPU host, eval/PERF_NOTES.md sessions 37-38).
        ``TurboCache`` calls it while the GPU is still far behind the prefill, where this host work costs nothing.
        A call of another query layout or options than remembered finds no match and binds as usual.
        ``stand_ins``: query stand-ins by layout, shared by the cache's layers."""
        call = _DECODE_CALLS.get((id(self.turbo_config), self.layer_idx))
        if call is None or self._decode_entry is not None or not self.is_initialized or not use_triton(self.device):
            return
        shape, stride, dtype, device = call[:4]
        here = self.device.index if self.device.type == "cuda" else -1  # Tensor.get_device's numbering
        if (len(shape) != 4 or shape[0] != self.batch or shape[3] != self.head_dim or shape[1] % self.n_kv_heads
                or device != here):
            return
        q = stand_ins.get(call[:4])
        if q is None:
            q = stand_ins[call[:4]] = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
        dec = _kernels("decode")
        self._bind_decode(dec, q, self._decode_stor(dec), call, rebind_only=True)

    def decode_inputs(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` that follow the query in ``turbo_decode_attention`` / ``turbo_decode_ref``
        for this layer's storage (benchmarks and tests call the kernel directly with them)."""
        cfg = self.turbo_config
        args = (self.groups, self.k_tail, self.v_tail, self.n_tail, self.k_scale, self.v_scale, self.k_mean)
        return args, dict(n_sink=self.n_sink, softmax=cfg.softmax, sas_threshold=cfg.sas_threshold)

    # ------------------------------------------------------------------ HF cache API
    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.n_blocks * self.turbo_config.block_size + self.n_tail

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Drop everything; the next update is a first prefill again (new universal scales)."""
        self._clear()

    def _tensors(self):
        names = ("k_tail", "v_tail", "k_mean", "k_scale", "v_scale", "qk_smooth")
        return [(n, getattr(self, n)) for n in names if getattr(self, n) is not None]

    def _index_batch(self, idx: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        idx = idx.to(self.device)
        for name, t in self._tensors():
            setattr(self, name, t.index_select(0, idx))
        if self.nonfinite is not None:  # off the old storage buffer, which then goes
            self.nonfinite = self.nonfinite.clone()
        self._flat = None
        for grp in self.groups:
            grp.index_batch(idx)
        self.batch = int(idx.numel())
        self._token_shape = None  # another batch: the next token takes update's checks

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]`` (packed storage gathered, not dequantized)."""
        self._index_batch(torch.as_tensor(beam_idx, dtype=torch.long))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._index_batch(torch.arange(self.batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        idx = torch.as_tensor(indices)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        self._index_batch(idx.long())

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (negative, transformers >= 5.2x) or keep the first
        ``tokens_to_remove`` (positive: the older ``max_length`` meaning); 0 removes nothing (transformers
        calls ``crop(0)`` in assisted decoding when every candidate matched).

        Cropping inside a packed block moves that block's kept tokens back into the INT8 tail as their
        dequantized INT8 values (``code * scale_int + zero``), exactly what attention read before; when the
        tail fills again they are packed with the new tokens (a second rounding of those tokens only).
        """
        tokens_to_remove = int(tokens_to_remove)  # transformers 5.17 passes a 0-d tensor
        if not self.is_initialized or tokens_to_remove == 0:
            return
        if "_pend" in self.__dict__:  # the stored tokens as they are, before the lengths change
            self._settle()
        n = self.get_seq_length()
        new_len = max(n + tokens_to_remove, 0) if tokens_to_remove < 0 else min(tokens_to_remove, n)
        if new_len >= n:
            return
        if new_len == 0:
            self._clear()
            return
        bs = self.turbo_config.block_size
        p0 = self.n_sink  # first packed position
        if new_len <= p0 or new_len >= p0 + self.n_blocks * bs:  # the cut lies in the INT8 buffer
            if new_len <= p0:
                for grp in self.groups:
                    grp.truncate(0)
            self.n_tail = new_len - self.n_blocks * bs if new_len > p0 else new_len
            return
        nb, nt = divmod(new_len - p0, bs)
        if nt:
            for grp in self.groups:
                k8, v8 = grp.unpack_block(nb)
                idx = grp.heads.long()
                self.k_tail[:, idx, p0:p0 + nt] = k8[:, :, :nt]
                self.v_tail[:, idx, :, p0:p0 + nt] = v8[:, :, :nt].transpose(-1, -2)
        for grp in self.groups:
            grp.truncate(nb)
        self.n_tail = p0 + nt

    def offload(self):
        if self.is_initialized:
            self._move("cpu")

    def prefetch(self):
        if self.is_initialized and self.k_tail.device != self.device:
            self._move(self.device)

    def _move(self, device) -> None:
        for name, t in self._tensors():
            setattr(self, name, t.to(device, non_blocking=True))
        for grp in self.groups:
            for name, t in grp._tensors():
                setattr(grp, name, t.to(device, non_blocking=True))
            grp.heads, grp.flat = grp.heads.to(device), None
        if self.nonfinite is not None:
            self.nonfinite = self.nonfinite.to(device, non_blocking=True)

    # ------------------------------------------------------------------ memory
    def bytes_per_token(self) -> float:
        """Bytes per stored token of one sequence in full packed blocks (K + V of all KV heads, with the
        per-block scale/zero bytes amortised): Σ_h d·(bits_h + k_bits_h)/8 + the scale/zero bytes
        (``kv_bytes_per_token``)."""
        if not self.is_initialized:
            return 0.0
        bs = self.turbo_config.block_size
        if not self.groups:
            return sum(kv_bytes_per_token(self.head_dim, hb, bs, self._k_bits(hb)) for hb in self._plan_bits)
        return sum(len(g.heads) * kv_bytes_per_token(self.head_dim, g.bits, bs, g.k_bits) for g in self.groups)

    def memory_bytes(self, allocated: bool = False) -> int:
        """Bytes of this layer's cache: the valid packed blocks (data + scale/zero), the INT8 tail buffers
        (their full ``block_size`` capacity), and the fp32 universal scales/means. ``allocated=True``
        counts the packed buffers' reserved capacity instead of the valid blocks."""
        if not self.is_initialized:
            return 0
        total = sum(t.numel() * t.element_size() for _, t in self._tensors())
        for grp in self.groups:
            total += grp.allocated_bytes() if allocated else grp.used_bytes()
        return total


class _KeepsTheWholeWindow:
    """What the two sliding-window layers share: every token is stored (the window is applied in attention), so
    assisted decoding's past recording has nothing to record."""

    is_sliding = True

    def activate_past_recording(self, **kwargs):
        # transformers >= 5.25 passes recurrent_states_to_keep=, which only linear-attention layers use
        self.record_past = True


class TurboSlidingWindowLayer(_KeepsTheWholeWindow, TurboLayer):
    """Sliding-window twin: stores every token like :class:`TurboLayer` (the window is applied in attention,
    so the mask offset stays 0); ``sliding_window`` is kept for reference."""

    def __init__(self, turbo_config: TurboConfig, layer_idx: int = 0, n_layers: Optional[int] = None,
                 sliding_window: Optional[int] = None, **kwargs):
        super().__init__(turbo_config, layer_idx, n_layers)
        self.sliding_window = sliding_window


class TurboCacheFullError(RuntimeError):
    """A static TurboCache got more tokens than its ``max_cache_len``."""


class TurboStaticLayer(TurboLayer):
    """A full-attention layer with storage for ``max_cache_len`` tokens, allocated at the first prefill and never
    reallocated, and its lengths ``lens = [n_blocks, n_tail]`` (int32) on the device: a decode step (one token per
    row) is a fixed sequence of launches with fixed arguments — ``turbo_attn::store_step`` (store the token, pack
    a block when the INT8 buffer fills) and ``turbo_attn::decode_step`` (attention; the kernel reads ``lens``) —
    so torch.compile traces it without a graph break and CUDA graphs replay it (``is_compileable``).

    Prefills (more than one token) run eagerly through :class:`TurboLayer`'s store on host lengths; eager decode
    steps keep the host lengths in step for free (the same rule as the kernel), compiled ones mark them stale
    and the next host-side call reads ``lens`` once. More than ``max_cache_len`` tokens raise
    :class:`TurboCacheFullError` before anything is stored (eager); inside a CUDA graph a step that finds the
    packed storage full stores nothing and counts itself, and the next host-side call raises.
    """

    is_compileable = True
    #: the layer's tensors are allocated one by one (no first-prefill replay), then gathered into one byte buffer,
    #: ``_side`` (``_step_args``); each group's are views of its own buffer. A compiled step takes those buffers
    #: and ``lens`` as its inputs (not views of them: aot_autograd takes no mutation of views in several dtypes)
    _one_buffer = False

    def __init__(self, turbo_config: TurboConfig, layer_idx: int = 0, n_layers: Optional[int] = None,
                 max_cache_len: Optional[int] = None, **kwargs):
        if max_cache_len is None or int(max_cache_len) <= 0:
            raise TurboConfigError(f"a static TurboCache needs max_cache_len > 0, got {max_cache_len!r}")
        self.max_cache_len = int(max_cache_len)
        super().__init__(turbo_config, layer_idx, n_layers)

    def _clear(self) -> None:
        super()._clear()
        self.lens = self.counters = None
        self._side: Optional[torch.Tensor] = None  # the byte buffer of the layer's STEP_TENSORS and head maps
        self._side_specs: Optional[tuple] = None  # the (name, shape, dtype) of _side's views
        self._step: Optional[tuple] = None  # (buffers, layout id) the two ops take (_step_args)
        self._lens_at = 0  # lens' byte offset in _side (_index_step): get_seq_length inside a compiled step
        self._host_stale = False
        self._adopted = False  # the storage is the one an earlier generate() used (its decode entry is warm)

    def reset(self) -> None:
        """Empty the layer but keep its storage: the next first prefill writes into the same tensors
        (:meth:`_adopt_kept`), so a CUDA graph captured over them replays instead of re-recording (a new address
        per generate() made cudagraph trees record the decode step again every call)."""
        kept = self._storage() if self.is_initialized and self.k_scale is not None else None
        super().reset()
        self._kept = kept

    def _storage(self) -> dict:
        """Every tensor a compiled decode step reads or writes by address, keyed by where it lives."""
        out = {("layer", n): t for n, t in self._tensors()}
        for n in ("lens", "counters", "nonfinite", "_flat", "_side"):
            if getattr(self, n, None) is not None:
                out[("layer", n)] = getattr(self, n)
        for i, grp in enumerate(self.groups):
            out[("group", i, "heads")] = grp.heads
            out.update({("group", i, n): t for n, t in grp._tensors()})
            if grp.flat is not None:
                out[("group", i, "flat")] = grp.flat
        return out

    def _empty(self, key: tuple, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The kept tensor of that name (:meth:`reset`) when its layout is the one asked for: the first prefill
        then writes the storage in place (no second copy of the cache in memory, no copy back); else a new one."""
        t = self._kept.get(key) if getattr(self, "_kept", None) else None
        if t is not None and tuple(t.shape) == tuple(shape) and t.dtype == dtype and t.device == self.device \
                and t.is_contiguous():
            return t
        return super()._empty(key, shape, dtype)

    def _adopt_kept(self) -> None:
        """After a first prefill that follows :meth:`reset`: when every tensor has the kept layout (same batch,
        capacity and config), use the kept tensors — the storage was written into them (:meth:`_empty`); the few
        that kernels return new (scales, mean, factors, head maps) are copied in, in one launch — else keep the
        new ones."""
        kept, self._kept = getattr(self, "_kept", None), None
        self._adopted = False
        if not kept:
            return
        cur = self._storage()
        same = cur.keys() == kept.keys() and all(
            t.shape == kept[k].shape and t.stride() == kept[k].stride() and t.dtype == kept[k].dtype
            and t.device == kept[k].device for k, t in cur.items())
        if not same:
            return
        olds, news = [], []
        for key, t in cur.items():
            old = kept[key]
            if old is not t:
                if old.data_ptr() != t.data_ptr():  # a view of the kept buffer (_empty) holds its data already
                    olds.append(old)
                    news.append(t)
                setattr(self if key[0] == "layer" else self.groups[key[1]], key[-1], old)
        if olds:
            torch._foreach_copy_(olds, news)
        self._adopted = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.turbo_config
        from .kernels.reference import int8_buffer_layout

        # the most blocks max_cache_len tokens ever pack (reference.int8_buffer_layout)
        self._cap_blocks = max(1, int8_buffer_layout(self.max_cache_len, cfg.block_size, cfg.sink_blocks,
                                                     cfg.recent_blocks)[0])
        super().lazy_initialization(key_states, value_states)
        fresh = self._fresh
        self.lens = fresh.pop("lens")  # written by _push_lens
        self.counters = fresh.pop("counters").zero_()  # arrival (0 between steps), overflow

    def _extra_specs(self) -> tuple:
        return (("lens", (2,), torch.int32), ("counters", (2,), torch.int32))

    def _make_groups(self, head_bits: list[int], capacity: int = 1, maps: Optional[dict] = None,
                     one_buffer: Optional[bool] = None) -> None:
        super()._make_groups(head_bits, max(capacity, self._cap_blocks), maps, one_buffer=True)

    # ------------------------------------------------------------------ what the ops take
    def _step_args(self) -> tuple:
        """``(buffers, layout)`` of ``turbo_attn::store_step`` / ``decode_step``: ``_side`` and the groups' buffers,
        and the id of where the tensors lie in them (``ops.step_layout``). Made eagerly after a storage change
        (a prefill, a batch change, a move); a compiled step only reads it."""
        if self._step is None:
            if torch.compiler.is_compiling():
                raise TurboConfigError(f"TurboCache layer {self.layer_idx}: its storage changed inside a compiled "
                                       "step; run prefills and batch changes eagerly")
            self._gather_side()
            self._index_step()
        return self._step

    def _index_step(self) -> None:
        """``_step`` from the buffers the tensors lie in now (gathered: ``_gather_side``)."""
        from .ops import step_layout

        bufs = [self._side] + [g.flat for g in self.groups if g.flat is not None]
        self._step = (bufs, step_layout(self, bufs))
        self._lens_at = self.lens.data_ptr() - self._side.data_ptr()

    def _gather_side(self) -> None:
        """Copy the layer's ``STEP_TENSORS`` and the groups' head maps (and a group's tensors where it has no
        buffer) into ``_side`` (one launch) and make them views of it. The buffer is the kept one after
        :meth:`reset` where the layout is the same, and the first prefill then wrote there already: no copy; a later
        prefill keeps the layer's own."""
        from .kernels.arena import carve
        from .ops import STEP_TENSORS

        loose = [(self, n) for n in STEP_TENSORS if getattr(self, n) is not None]
        for grp in self.groups:
            loose.append((grp, "heads"))
            if grp.flat is None:
                loose += [(grp, n) for n, _ in grp._tensors()]
        specs = tuple((str(i), tuple(getattr(o, n).shape), getattr(o, n).dtype) for i, (o, n) in enumerate(loose))
        own = self._side if self._side is not None and self._side_specs == specs else None
        views = carve(specs, lambda name, shape, dtype: own if own is not None else
                      self._empty(("layer", "_side"), shape, dtype))
        side = self._side = views.pop("flat")
        self._side_specs = specs
        dst, src = [], []
        for i, (obj, name) in enumerate(loose):
            t, v = getattr(obj, name), views[str(i)]
            if t.data_ptr() != v.data_ptr() or t.stride() != v.stride():
                dst.append(v)  # a kept view elsewhere in the same buffer is read before anything is written
                src.append(t.clone() if t.untyped_storage().data_ptr() == side.untyped_storage().data_ptr() else t)
            setattr(obj, name, v)
        if dst:
            torch._foreach_copy_(dst, src)

    def _move(self, device) -> None:
        super()._move(device)
        self._step = None  # new tensors: gathered again at the next eager step

    # ------------------------------------------------------------------ host view of the lengths
    def _sync_host(self) -> None:
        """Bring the host lengths up to date after compiled steps (one host sync), and raise if a step overflowed."""
        if not self._host_stale or self.lens is None:
            return
        nb, nt, _, over = torch.cat([self.lens, self.counters]).tolist()
        for grp in self.groups:
            grp.n_blocks = nb
        self.n_tail = nt
        self._host_stale = False
        if over:
            raise TurboCacheFullError(
                f"TurboCache layer {self.layer_idx}: {over} decode step(s) found the static cache full "
                f"(max_cache_len={self.max_cache_len}); those tokens were not stored. Create the cache with a larger "
                "max_cache_len (generate(): max_cache_len / max_new_tokens)")

    @property
    def n_blocks(self) -> int:
        self._sync_host()
        return self.groups[0].n_blocks if self.groups else 0

    def _push_lens(self) -> None:
        # two fills, not a copy from a host tensor: a pageable host-to-device copy waits for the stream, which at
        # every layer of a prefill took away the host's lead over the GPU
        if self.lens is not None and self.k_scale is not None:
            self.lens[0].fill_(self.n_blocks)
            self.lens[1].fill_(self.n_tail)

    def _check_room(self, n_new: int) -> None:
        n = super().get_seq_length() if self.is_initialized else 0  # after _sync_host: the host value
        if n + n_new > self.max_cache_len:
            raise TurboCacheFullError(
                f"TurboCache layer {self.layer_idx} holds {n} tokens; {n_new} more exceed max_cache_len="
                f"{self.max_cache_len}. Nothing was stored; create the cache with a larger max_cache_len")

    def _mark_static(self) -> None:
        """Fixed addresses for torch.compile / CUDA graphs (as HF's StaticLayer does): the step's inputs."""
        if torch.compiler.is_compiling():
            return
        for t in self._step_args()[0] + [placeholder_element(self.dtype, self.device)]:
            torch._dynamo.mark_static_address(t)

    # ------------------------------------------------------------------ storing
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: Optional[dict] = None,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized or self.k_scale is None or key_states.shape[2] != 1:
            if torch.compiler.is_compiling():
                raise TurboConfigError(
                    f"TurboCache layer {self.layer_idx}: a static TurboCache compiles decode steps (one token per "
                    "row) only; run prefills eagerly (HF generate() does)")
            self._sync_host()
            self._check_room(key_states.shape[2])
            out = super().update(key_states, value_states, cache_kwargs, *args, **kwargs)
            self._step = None
            if self.k_scale is not None:
                self._gather_side()  # into the kept buffer, before _adopt_kept compares the layouts
            self._adopt_kept()
            if self.k_scale is not None:
                self._index_step()  # after _adopt_kept, which may hand the groups their kept buffers
            self._push_lens()
            self._mark_static()
            return out
        b, hk, _, d = key_states.shape
        if (b, hk, d) != (self.batch, self.n_kv_heads, self.head_dim):
            raise ValueError(
                f"TurboCache layer {self.layer_idx} holds [batch {self.batch}, {self.n_kv_heads} KV heads, "
                f"head_dim {self.head_dim}] but got key states {tuple(key_states.shape)}"
            )
        if not torch.compiler.is_compiling():
            self._sync_host()
            self._check_room(1)
        bufs, layout = self._step_args()
        torch.ops.turbo_attn.store_step(key_states, value_states, bufs, layout, self.n_sink, self.rotated)
        if torch.compiler.is_compiling():
            self._host_stale = True
        else:  # the kernel's rule on the host lengths: no sync in an eager step
            C, bs = self.k_tail.shape[2], self.turbo_config.block_size
            if self.n_tail + 1 == C:
                for grp in self.groups:
                    grp.n_blocks += 1
                self.n_tail = C - bs
            else:
                self.n_tail += 1
        self._first_prefill = False
        return self._placeholders(self.max_cache_len)

    # ------------------------------------------------------------------ attention
    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale=None,
                  causal: bool = True, window=None, softcap=None, key_valid=None) -> torch.Tensor:
        """A decode step (one query token per row over the placeholders of ``update``): ``turbo_attn::decode_step``
        over the storage with the device lengths; anything else as :meth:`TurboLayer.attention`."""
        if self._first_prefill or query.shape[2] != 1 or key.shape[2] != self.max_cache_len:
            out = super().attention(query, key, value, scale=scale, causal=causal, window=window, softcap=softcap,
                                    key_valid=key_valid)
            if not torch.compiler.is_compiling() and use_triton(query.device) and not self._adopted:
                # one decode launch now, eagerly: it compiles the kernel and allocates the split's partials (a
                # process-wide workspace) outside any CUDA-graph capture, where they would outlive the graph
                # (done already for storage kept from an earlier generate(): _adopt_kept)
                self._decode_op(query[:, :, -1:], None, scale, causal, window, softcap)
            return out
        if self.rotated:
            self._check_keys(key)
        return self._decode_op(query, key_valid, scale, causal, window, softcap)

    def _decode_op(self, query, key_valid, scale, causal, window, softcap) -> torch.Tensor:
        cfg = self.turbo_config
        bufs, layout = self._step_args()
        q = query if query.dtype in (torch.bfloat16, torch.float16) or not use_triton(query.device) else \
            query.to(torch.bfloat16)
        out = torch.ops.turbo_attn.decode_step(
            q, bufs, layout, self.n_sink, key_valid,
            float(scale) if scale is not None else float(query.shape[-1] ** -0.5), bool(causal), int(window or 0),
            float(softcap or 0.0), cfg.softmax, float(cfg.sas_threshold), self.rotated)
        return out.to(query.dtype)

    # ------------------------------------------------------------------ HF cache API
    def get_seq_length(self):
        """Stored tokens: a host int while the host lengths are current (prefills, eager steps), else — inside a
        compiled step, or between compiled steps — a 0-d device tensor, as HF's StaticLayer returns: generate() asks
        every step (mask creation), and reading ``lens`` as an int there would stall the host on the GPU."""
        if torch.compiler.is_compiling() and self.lens is not None:
            # read through _side, a graph input already: ``self.lens`` would be one more, aliasing it
            lens = self._side[self._lens_at:self._lens_at + 8].view(torch.int32)
            return lens[0] * self.turbo_config.block_size + lens[1]
        if self._host_stale and self.lens is not None:  # (no guard on the flag)
            return self.lens[0] * self.turbo_config.block_size + self.lens[1]
        return super().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if query_length == 1:  # a decode step: the same mask shape every step (the kernel reads the lengths)
            if not torch.compiler.is_compiling() and self.k_scale is not None and not self._host_stale:
                n = super().get_seq_length()
                if n + 1 > self.max_cache_len:  # a mask that fits, so that update() raises the named error
                    return n + 1, 0
            return self.max_cache_len, 0
        self._sync_host()
        return super().get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def _index_batch(self, idx: torch.Tensor) -> None:
        """Beam reorder: gathered in place when the batch size is unchanged (the addresses CUDA graphs hold stay)."""
        if not self.is_initialized:
            return
        idx = idx.to(self.device)
        if int(idx.numel()) != self.batch:
            super()._index_batch(idx)
            self._step = None
            return
        for _, t in self._tensors():
            t.copy_(t.index_select(0, idx))
        for grp in self.groups:
            for _, t in grp._tensors():
                t.copy_(t.index_select(0, idx))

    def crop(self, tokens_to_remove: int) -> None:
        self._sync_host()
        super().crop(tokens_to_remove)
        self._push_lens()


class TurboStaticSlidingWindowLayer(_KeepsTheWholeWindow, TurboStaticLayer):
    """Sliding-window twin of :class:`TurboStaticLayer` (every token kept; the window is applied in attention)."""

    def __init__(self, turbo_config: TurboConfig, layer_idx: int = 0, n_layers: Optional[int] = None,
                 max_cache_len: Optional[int] = None, sliding_window: Optional[int] = None, **kwargs):
        super().__init__(turbo_config, layer_idx, n_layers, max_cache_len=max_cache_len)
        self.sliding_window = sliding_window


#: (id of the TurboConfig, layer index) -> the ``attention`` call key of that layer's last first decode call (the
#: config object is the key's last item, so its id is not reused while remembered): ``TurboLayer.prepare_decode``
_DECODE_CALLS: dict = {}


def _remember_decode_call(layer_idx: int, call: tuple) -> None:
    if len(_DECODE_CALLS) >= 1024:  # many configs or models in one process: remembered again on demand
        _DECODE_CALLS.clear()
    _DECODE_CALLS[(id(call[-1]), layer_idx)] = call


#: ``TurboCache.from_template``'s fresh layers by (class, config and model config ids, template layer kinds): each
#: turbo layer's class and ``__dict__`` (with the objects checked by identity), cloned for the next generate() —
#: building 32 layers one attribute at a time cost ~95 us on the CPU box, ~0.5 ms on the GPU host, per prompt
_BLANK_LAYERS: dict = {}


def _blank(layer: "TurboLayer") -> tuple:
    """``(class, __dict__, its containers)`` of a fresh layer, for :func:`_clone`."""
    d = dict(layer.__dict__)
    return type(layer), d, tuple((k, v) for k, v in d.items() if type(v) in (list, dict, set))


def _clone(blank: tuple) -> "TurboLayer":
    """A fresh layer from ``_BLANK_LAYERS``' :func:`_blank`: its containers copied, everything else shared (the
    config, ints, None)."""
    cls, d, containers = blank
    layer = cls.__new__(cls)
    ld = layer.__dict__
    ld.update(d)
    for k, v in containers:
        ld[k] = v.copy()
    return layer


#: (dtype, device) -> the one element every layer's ``update()`` placeholders are expanded from: one tensor for the
#: whole model, so a compiled step has one such input, not one a layer
_PLACEHOLDER_ELEMENTS: dict = {}


def placeholder_element(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = _PLACEHOLDER_ELEMENTS.get((dtype, device))
    if t is None:
        t = _PLACEHOLDER_ELEMENTS[(dtype, device)] = torch.empty(1, dtype=dtype, device=device)
    return t


def _kv_heads(config: Any) -> Optional[int]:
    """The model's KV heads per layer, or None without a config."""
    if config is None:
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)


def _layer_types(text_config) -> list[str]:
    n = text_config.num_hidden_layers
    types = getattr(text_config, "layer_types", None)
    if types is None:
        if getattr(text_config, "sliding_window", None) is not None:
            types = ["sliding_attention"] * n
        else:
            types = ["full_attention"] * n
    return list(types)


class TurboCache(Cache):
    """Quantized KV cache for ``attn_implementation="turbo_int8"`` (pass it as ``past_key_values=``, ``cache=``
    on transformers >= 5.24: ``generation.cache_arg``).

    Args:
        turbo_config: a :class:`~turbo_attn_hf.config.TurboConfig`, a preset name (``"int8"``, ``"int4"``,
            ``"mixed"``) or a YAML path; None = the model's configured one (``config.turbo_attn``), else the
            default preset.
        config: the model's (HF) config; gives the layer count and which layers are full / sliding-window
            attention. Without it layers are created on first use as full-attention layers.
    """

    _first_stores: Optional[first_prefill.Batch] = None  # a copy made without __init__ queues nothing
    _gpu_mark = None  # a CUDA event at a first prefill's middle layer (_prepare_decode)

    def __init__(self, turbo_config: TurboConfig | str | None = None, *, config: Any = None,
                 layers: Optional[list] = None, max_cache_len: Optional[int] = None):
        self.turbo_config = _resolve_config(turbo_config, config)
        self.n_layers: Optional[int] = None
        if max_cache_len is not None and (int(max_cache_len) <= 0 or (layers is None and config is None)):
            raise TurboConfigError(
                f"a static TurboCache needs max_cache_len > 0 and the model's config (got max_cache_len="
                f"{max_cache_len!r}, config={'given' if config is not None else None}): "
                "TurboCache(preset, config=model.config, max_cache_len=N)")
        static = max_cache_len is not None
        if layers is None and config is not None:
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            self.n_layers = text.num_hidden_layers
            layers = []
            for i, t in enumerate(_layer_types(text)):
                if t == "full_attention":
                    layers.append(TurboStaticLayer(self.turbo_config, i, self.n_layers, max_cache_len=max_cache_len)
                                  if static else TurboLayer(self.turbo_config, i, self.n_layers))
                elif t in ("sliding_attention", "chunked_attention"):
                    w = getattr(text, "sliding_window", None) if t == "sliding_attention" else \
                        getattr(text, "attention_chunk_size", None)
                    layers.append(TurboStaticSlidingWindowLayer(self.turbo_config, i, self.n_layers,
                                                                max_cache_len=max_cache_len, sliding_window=w)
                                  if static else
                                  TurboSlidingWindowLayer(self.turbo_config, i, self.n_layers, sliding_window=w))
                else:
                    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

                    layers.append(DYNAMIC_LAYER_TYPE_MAPPING.get(t, DynamicLayer)())
        elif layers is not None:
            self.n_layers = len(layers)
        # the layers' first stores wait for the last layer (first_prefill.Batch), where the layer count is known
        self._first_stores = first_prefill.Batch() if self.n_layers is not None else None
        if config is not None:
            kv, rope = _kv_heads(config), rope_layout(config, self.turbo_config.k_scale_range == "rope_pair")
            for i, layer in enumerate(layers or []):
                if isinstance(layer, TurboLayer):
                    layer.n_kv_heads_total = kv
                    layer.rope_dims = rope_dims(config, i, layout=rope)
        super().__init__(layers=layers if layers is not None else [])

    @classmethod
    def from_template(cls, cache: Cache, turbo_config: TurboConfig | str | None, model_config: Any = None
                      ) -> "TurboCache":
        """Convert a freshly built ``DynamicCache`` layer by layer: full-attention and sliding-window layers
        become their turbo twins, any other layer object is kept. A template layer that already holds
        tokens is quantized into its twin (as a first prefill)."""
        cfg = _resolve_config(turbo_config, model_config)
        if not cache.layers:
            return cls(cfg, config=model_config)
        kinds = tuple((type(layer), getattr(layer, "sliding_window", None), layer.is_initialized)
                      for layer in cache.layers)
        key = (cls, id(cfg), id(model_config), kinds)
        hit = _BLANK_LAYERS.get(key)
        if hit is not None and hit[0] is cfg and hit[1] is model_config:  # generate(): a new cache per call
            return cls(cfg, layers=[_clone(blank) if blank is not None else layer
                                    for blank, layer in zip(hit[2], cache.layers)])
        n = len(cache.layers)
        layers = []
        kv, rope = _kv_heads(model_config), rope_layout(model_config, cfg.k_scale_range == "rope_pair")
        for i, layer in enumerate(cache.layers):
            if type(layer) is DynamicLayer:
                new = TurboLayer(cfg, i, n)
            elif type(layer) is DynamicSlidingWindowLayer:
                new = TurboSlidingWindowLayer(cfg, i, n, sliding_window=layer.sliding_window)
            else:
                layers.append(layer)
                continue
            new.n_kv_heads_total = kv
            new.rope_dims = rope_dims(model_config, i, layout=rope)
            if layer.is_initialized and layer.keys is not None and layer.keys.numel() and layer.get_seq_length():
                new.update(layer.keys, layer.values)
            layers.append(new)
        if not any(k[2] for k in kinds):  # fresh layers: the next cache of this model clones them
            if len(_BLANK_LAYERS) >= 64:
                _BLANK_LAYERS.clear()
            _BLANK_LAYERS[key] = (cfg, model_config, [_blank(x) if isinstance(x, TurboLayer) else None for x in layers])
        return cls(cfg, layers=layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:  # no model config given: full-attention layers on first use
            self.layers.append(TurboLayer(self.turbo_config, len(self.layers), self.n_layers))
        layer = self.layers[layer_idx]
        out = None
        # a decode token whose store the decode launch takes (a static layer never defers): no launch here, so no
        # device switch
        if getattr(layer, "_token_shape", None) == key_states.shape and not self.offloading:
            out = layer.defer_token(key_states, value_states)
        # a first prefill replayed (first_prefill) needs no device switch: replay() launches only on the device it
        # recorded on
        if out is None and (not layer.is_initialized and not self.offloading and isinstance(layer, TurboLayer)
                            and layer._replay_first_prefill(key_states, value_states, self._first_stores)):
            out = layer._first_prefill_keys(key_states, value_states)
            if layer_idx == len(self.layers) // 2 and key_states.is_cuda:
                # the middle layer's event: the last layer asks it how far behind the GPU is (_prepare_decode)
                self._gpu_mark = torch.cuda.Event()
                self._gpu_mark.record(torch.cuda.current_stream(key_states.device))
        if out is None:
            with on_tensor_device(key_states):  # the store kernels launch on the layer's GPU (device_map="auto")
                out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        batch = self._first_stores
        if batch is not None and batch.items and layer_idx == len(self.layers) - 1:
            batch.flush()  # the forward's last layer: its queued first stores launch together
        if self._gpu_mark is not None and layer_idx == len(self.layers) - 1:
            self._prepare_decode()
        return out

    def _prepare_decode(self) -> None:
        """At a first prefill's last layer: if the GPU has not yet reached the forward's middle layer, it has at
        least half a prefill of work queued, so the host's wait for the first token starts here; spend it on the
        first decode step's views and entries (``TurboLayer.prepare_decode``). A GPU that keeps up (a short prompt
        on a fast GPU: the host is the bottleneck) leaves them to first use, as before."""
        mark, self._gpu_mark = self._gpu_mark, None
        if mark.query():
            return
        stand_ins: dict = {}
        for layer in self.layers:
            if isinstance(layer, TurboLayer) and not layer.is_compileable and layer._first_prefill:
                layer.prepare_decode(stand_ins)

    def nonfinite_tokens(self) -> int:
        """Stored (layer, batch row, KV head, token) vectors whose K or V held an inf/NaN: they were stored as
        code 0 and left out of the universal scales. One host sync (the counters live on the device)."""
        cs = [l.nonfinite for l in self.layers
              if isinstance(l, TurboLayer) and l.nonfinite is not None and l.k_scale is not None]
        if not cs:
            return 0
        return int(torch.stack([c.to(cs[0].device).reshape(()) for c in cs]).sum().item())

    def has_nonfinite(self) -> bool:
        """Whether any stored K/V vector held an inf/NaN (see :meth:`nonfinite_tokens`; one host sync)."""
        return self.nonfinite_tokens() > 0

    def memory_bytes(self, allocated: bool = False) -> int:
        """Bytes held by all turbo layers (see :meth:`TurboLayer.memory_bytes`)."""
        return sum(l.memory_bytes(allocated) for l in self.layers if isinstance(l, TurboLayer))

    def bytes_per_token(self) -> float:
        """KV bytes per token of one sequence over all turbo layers, in full packed blocks."""
        return sum(l.bytes_per_token() for l in self.layers if isinstance(l, TurboLayer))

    def __repr__(self) -> str:
        return f"TurboCache(preset={self.turbo_config.name!r}, layers={len(self.layers)})"
