"""The `decode` problem's op (schema, shape rule, SDPA fallback) and its Hugging Face route.

Apart from decode.py because it imports torch when loaded, which the orchestrator does not.

The kernel takes q (B, Hq, Sq, D) with 1 <= Sq <= 16, the cache k, v (B, Hkv, Smax, D) and
cache_seqlens (int32, (B,)): sequence b's valid cache is its first L = cache_seqlens[b]
positions and query i of Sq sees keys 0 .. L - Sq + i; a query that sees no key gives zeros.

In transformers, the package's mask function (hf.register installs it) turns a causal mask
the kernel computes into cache_seqlens, which reach the attention layers in place of a mask:
1 to 16 new tokens after the L - Sq already cached (a generation step, the tokens a draft
model proposes, a short prompt), no padding, no window or pattern beyond causality. That holds
for the dynamic cache, whose layers get the cache of exactly L positions, and for the static
cache, whose layers get all Smax positions: its lengths are computed on the device from the
cache's own position tensor, so a step compiled with torch.compile or captured in a CUDA graph
(generate(..., cache_implementation="static")) replays with the next length. A batch with
padding keeps transformers' mask and runs its SDPA path, counted; telling the two apart reads
the 2D padding mask once per forward (transformers' own SDPA and flash-attention mask builders
read it too), except while torch.compile traces, where a 2D mask is left to SDPA. (generate
builds a static cache's masks before its compiled forward, outside the trace.)
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .decode import MAX_SQ
from .op import Args, OpSpec, parse_schema

SCHEMA = "(Tensor q, Tensor k, Tensor v, Tensor cache_seqlens, float? scale=None) -> Tensor"


def shape_refusal(a: Args) -> str | None:
    """Returns why a call is outside the decode contract, or None."""
    q, k, v, lens = a["q"], a["k"], a["v"], a["cache_seqlens"]
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        return f"expected q (B, Hq, Sq, D), k, v (B, Hkv, Smax, D); got {tuple(q.shape)}, " \
               f"{tuple(k.shape)}"
    if (k.shape[0], k.shape[3]) != (q.shape[0], q.shape[3]) or q.shape[1] % k.shape[1]:
        return f"cache {tuple(k.shape)} does not fit q {tuple(q.shape)} (Hq % Hkv == 0)"
    if not 1 <= q.shape[2] <= MAX_SQ:
        return f"{q.shape[2]} new tokens (the kernel takes 1 to {MAX_SQ})"
    if lens.dtype != torch.int32 or tuple(lens.shape) != (q.shape[0],):
        return f"cache_seqlens must be int32 of shape ({q.shape[0]},)"
    return None


def visible(q: torch.Tensor, k: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Returns the (B, 1, Sq, Smax) mask of the keys each query sees."""
    Sq = q.shape[2]
    j = torch.arange(k.shape[2], device=q.device)[None, None, :]
    last = lens.long()[:, None, None] - Sq + torch.arange(Sq, device=q.device)[None, :, None]
    return (j <= last)[:, None]


def fallback(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_seqlens: torch.Tensor,
             scale: float | None = None) -> torch.Tensor:
    """Decode attention by SDPA with the lengths' mask; rows with no key are zeros."""
    keep = visible(q, k, cache_seqlens)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return torch.where(keep.any(-1, keepdim=True), out, torch.zeros_like(out))


def op_spec() -> OpSpec:
    """Returns the decode op's spec."""
    return OpSpec(
        schema=SCHEMA, params=parse_schema(SCHEMA), shape_refusal=shape_refusal,
        call_kernel=lambda fn, q, k, v, lens, scale=None: fn(
            q, k, v, lens, scale=scale if scale is not None else q.shape[-1] ** -0.5),
        fallback_for=lambda a: fallback, flags=lambda a: {}, growing=("k", "v"),
        hf_call=hf_call, hf_lengths=True)


def is_lengths(mask: Any) -> bool:
    """Whether an attention layer's mask is cache_seqlens made by mask_lengths (int32, (B,)),
    where transformers' own masks are 4D, boolean or floating point."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 1 and mask.dtype == torch.int32


def mask_lengths(batch: int, q_length: int, kv_length: int, q_offset: Any, kv_offset: Any,
                 padding: torch.Tensor | None, plain: bool,
                 device: Any) -> torch.Tensor | None:
    """Returns cache_seqlens (int32, (batch,)) standing for the causal mask of q_length new
    tokens at q_offset over a cache of kv_length when the kernel computes it, else None.

    plain: the mask is causality alone (no window, no pattern, its caller allows a mask to be
    left out). q_offset is an int (the dynamic cache) or a 0-d tensor on the device (the
    static cache), which becomes the lengths through tensor operations. padding:
    transformers' 2D mask of the tokens seen so far, or None; every position of the
    L = q_offset + q_length must be kept, which is read here (L and the mask), once per
    forward, except while torch.compile traces."""
    if not plain or not 1 <= q_length <= MAX_SQ or not isinstance(kv_offset, int) or kv_offset:
        return None
    static = isinstance(q_offset, torch.Tensor)
    if device is None:
        device = q_offset.device if static else padding.device if padding is not None else "cpu"
    if padding is not None:
        if torch.compiler.is_compiling():
            return None                      # reading it would break the graph
        seen = int(q_offset) + q_length
        if padding.dim() != 2 or padding.shape[-1] < seen or not bool(padding[:, :seen].all()):
            return None
    if not static:
        seen = q_offset + q_length
        return _lengths(batch, seen, torch.device(device)) if seen <= kv_length else None
    seen = (q_offset.reshape(1) + q_length).clamp(max=kv_length)
    return seen.to(device=device, dtype=torch.int32).repeat(batch)


def hf_call(attention: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, mask: Any, scale: float | None, window: int | None,
            causal: bool) -> torch.Tensor | None:
    """Returns the op's output (B, Hq, Sq, D) for a transformers call it serves, else None:
    mask is cache_seqlens from mask_lengths, or None (no mask function registered) for a
    call whose cache is exactly its keys."""
    Sq, kv_len = q.shape[2], k.shape[2]
    if is_lengths(mask):
        if mask.shape[0] != q.shape[0] or not 1 <= Sq <= MAX_SQ:
            return None
        return attention(q, k, v, mask, scale=scale)
    one_step = Sq == 1 and kv_len >= 1
    short_prompt = causal and Sq == kv_len <= MAX_SQ
    if mask is not None or not (one_step or short_prompt):
        return None
    return attention(q, k, v, _lengths(q.shape[0], kv_len, q.device), scale=scale)


_LENGTHS: dict[tuple, torch.Tensor] = {}


def _lengths(batch: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Returns cache_seqlens of `batch` sequences of kv_len: in eager calls one tensor per step
    for every layer (nothing writes it), made anew while compiling or capturing a graph."""
    if torch.compiler.is_compiling() or (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    key = (batch, kv_len, device)
    lens = _LENGTHS.get(key)
    if lens is None:
        if len(_LENGTHS) >= 8:
            _LENGTHS.clear()
        lens = _LENGTHS[key] = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    return lens
