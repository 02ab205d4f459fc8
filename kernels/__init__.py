"""Triton kernels of turbo-attn-hf (installed as ``turbo_attn_hf.kernels``; no transformers import here).

Modules, one job each:
  reference  plain-PyTorch twin of every kernel's quantized math (the oracle), plus fp64 attention
  softmax    the SAS exp2 approximation (TurboAttention §4) as a @triton.jit helper
  quant      fused per-token / per-block INT8 quantization of attention operands
  prefill    INT8 flash-attention forward (INT-FlashAttention), causal/GQA/window/softcap/padding
  prefill_hopper  the same forward as a warp-specialized Gluon kernel for sm_90 (TMA, 8-bit wgmma; opt-in)
  pack       progressive INT8 -> INT4/INT2 block packing of the KV cache (TurboAttention FlashQ)
  decode     attention of a query chunk over packed blocks + INT8 tail, stream-K split (Lean Attention)
  rope       the rotary embedding of a layer's queries and keys in one launch (HF's rotate-half form, same bits)
"""
