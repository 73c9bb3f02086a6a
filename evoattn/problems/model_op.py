"""The `model` problem's op (schema, shape rule, fallback) and its transformers route.

Apart from model_prefill.py because it imports torch when loaded, which the orchestrator does
not.

The fallback computes every feature the op takes: SDPA where it can (a window as a boolean
mask; no softcap, no sinks), else transformers' eager math (model_baselines.eager_attention),
never SDPA with a feature dropped.

In transformers (hf.py), Gemma 2, GPT-OSS, Mistral and Llama prefill calls map to the op:
window = the layer's `sliding_window` (None on Gemma 2's and GPT-OSS's global layers, the
config's on every Mistral layer), softcap = Gemma 2's `softcap`, sinks = GPT-OSS's `s_aux`
(its module's sinks, cast to float32), scale = `scaling`. hf_window: the package's mask
function leaves the plain sliding-window causal mask out, as the kernel computes it. Calls
with a cache (query and key lengths differ) and masked calls take the model's own path.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .model_baselines import additive_mask, eager_attention
from .model_prefill import HEAD_DIMS, op_flags, visible
from .op import Args, OpSpec, parse_schema, scale_of

SCHEMA = ("(Tensor q, Tensor k, Tensor v, float? scale=None, int window=0, float softcap=0.0, "
          "Tensor? sinks=None) -> Tensor")
DTYPES = (torch.float16, torch.bfloat16)
# transformers' keyword arguments the route reads (Gemma 2's softcap, GPT-OSS's sinks)
HF_KWARGS = ("softcap", "s_aux")


def shape_refusal(a: Args) -> str | None:
    """Returns why a call is outside the `model` contract, or None."""
    q, k, v, sinks = a["q"], a["k"], a["v"], a["sinks"]
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        return f"expected q (B, H, S, D), k, v (B, Hkv, S, D); got {tuple(q.shape)}, " \
               f"{tuple(k.shape)}, {tuple(v.shape)}"
    B, H, S, D = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (B, S, D) or H % k.shape[1]:
        return f"k, v {tuple(k.shape)} do not fit q {tuple(q.shape)} (same B, S, D; H % Hkv == 0)"
    if D not in HEAD_DIMS:
        return f"head dim {D} (the contract takes {', '.join(map(str, HEAD_DIMS))})"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (the contract takes float16 and bfloat16)"
    if a["window"] < 0 or a["softcap"] < 0:
        return f"window and softcap must be >= 0; got {a['window']}, {a['softcap']}"
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (H,)):
        return f"sinks must be float32 of shape ({H},); got {sinks.dtype} {tuple(sinks.shape)}"
    return None


def _keep(q: torch.Tensor, window: int) -> torch.Tensor:
    """Returns the (S, S) boolean mask of the keys each query sees."""
    idx = torch.arange(q.shape[2], device=q.device)
    return visible(idx[:, None], idx[None, :], window)


def sdpa_fallback(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  window: int = 0, softcap: float = 0.0,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The op by SDPA, for calls without softcap and sinks (fallback_for says which)."""
    gqa = k.shape[1] != q.shape[1]
    if window <= 0 or window >= q.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_keep(q, window), scale=scale,
                                          enable_gqa=gqa)


def eager_fallback(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                   window: int = 0, softcap: float = 0.0,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The op by transformers' eager math: every feature."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    mask = additive_mask(_keep(q, window), q.dtype)
    return eager_attention(q, k, v, scale, softcap, mask, sinks)


def fallback_for(a: Args) -> Callable[..., torch.Tensor]:
    """SDPA for a call it computes whole, the eager math for softcap or sinks."""
    return eager_fallback if a["softcap"] or a["sinks"] is not None else sdpa_fallback


def hf_call(attention: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, mask: Any, scale: float | None, window: int | None, causal: bool,
            softcap: float | None = None, s_aux: torch.Tensor | None = None
            ) -> torch.Tensor | None:
    """Returns the op's output (B, H, S, D) for a causal prefill call (hf.py has refused masks
    and differing lengths), else None. Keyword arguments are read by identity."""
    if mask is not None or (not causal and q.shape[2] > 1) or q.shape[2] != k.shape[2]:
        return None
    sinks = None if s_aux is None else s_aux.float()
    return attention(q, k, v, scale, 0 if window is None else int(window),
                     0.0 if softcap is None else float(softcap), sinks)


def op_spec() -> OpSpec:
    """Returns the op's spec: GQA read in place; flags checked against the verified set."""
    return OpSpec(
        schema=SCHEMA, params=parse_schema(SCHEMA), shape_refusal=shape_refusal,
        call_kernel=lambda fn, q, k, v, scale=None, window=0, softcap=0.0, sinks=None: fn(
            q, k, v, scale=scale_of(q, scale), window=window, softcap=softcap, sinks=sinks),
        fallback_for=fallback_for,
        flags=lambda a: op_flags(a["window"], a["softcap"], a["sinks"] is not None),
        hf_call=hf_call, hf_window=True, hf_kwargs=HF_KWARGS)
