"""Hugging Face transformers integration: `register()`, then `attn_implementation="evoattn"`.

    from PACKAGE import hf
    hf.register()                 # AttentionInterface.register("evoattn", hf.attention_forward)
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="evoattn")

    decode_pkg.hf.register(prefill=sdpa_pkg)   # a decode kernel's prompts: a prefill kernel's

transformers passes q, k, v as (B, H, S, D) views of (B, S, H, D) projections (k, v with fewer
heads under GQA) and wants (B, S, H, D) back: eagerly, a kernel that lays its output out as q
(the default seed) gives one that transposes back without a copy, as SDPA's does (under
torch.compile the op's output is contiguous, and transposing it back copies). `register` also
registers the mask builder, so that a call with nothing to mask but causality gets no mask (as
SDPA does) and a padded batch gets its mask. A call the kernel's problem covers goes through
the op (whose guard may still fall back); anything else is counted as a fallback with its
reason (an attention mask, query and key lengths that differ (decoding with a cache), dropout
while training, output_attentions, softcap, a position bias, attention sinks, a paged cache)
and runs transformers' own SDPA path, or, where it passes a feature SDPA lacks (softcap,
sinks, output_attentions), the model's own eager attention (_hf_fallback).

Per problem: `sdpa` and `gqa` take causal and non-causal prefill, k and v passed as they are
(the op gives them to a kernel that takes GQA and strides, and contiguous, repeated copies to
one that does not); `sliding_window` takes the model's `sliding_window` (a
plain causal call is a window as long as the sequence); `masked` serves unmasked causal calls
through an explicit causal mask, and no padding mask (its contract excludes the fully masked
rows that left padding makes); `decode` serves 1 to 16 new tokens over the dynamic or the
static cache of a batch with no padding, its mask function handing the layers the cache's
lengths instead of a mask (decode.py says which); `model` takes causal prefill with the
layer's `sliding_window`, Gemma 2's `softcap` and GPT-OSS's sinks (`s_aux`), and leaves calls
over a cache to the model's own path (model_op.py says which); `strided` and user problems
have no transformers mapping.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from . import _hf_fallback, decode, ops

NAME = "evoattn"
# Keyword arguments the kernel does not take (those SDPA lacks too: _hf_fallback.BEYOND_SDPA).
_UNSUPPORTED_KWARGS = ("output_attentions", "softcap", "position_bias", "cache", "s_aux", "sinks")


def register(name: str = NAME, prefill: Any = None) -> str:
    """Registers the attention function (and its mask function) with transformers; returns name.

    prefill: another exported package of the sdpa or gqa problem (the package, its name or
    its hf module), whose attention function takes the calls this kernel does not, instead of
    transformers' SDPA: a decode package's prompts go to a prefill kernel. That package
    counts those calls (its stats()); they are not this package's fallbacks."""
    from transformers import AttentionInterface
    forward = attention_forward
    if prefill is not None:
        forward = functools.partial(_attention, then=_prefill_forward(prefill))
        functools.update_wrapper(forward, attention_forward)
    AttentionInterface.register(name, forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:       # transformers before 4.53: masks follow the sdpa path already
        return name
    AttentionMaskInterface.register(name, _mask_function())
    return name


def _prefill_forward(prefill: Any) -> Any:
    """Returns the attention function of `prefill` (a package or its hf module), checked."""
    hf = prefill if hasattr(prefill, "attention_forward") else \
        importlib.import_module(f"{getattr(prefill, '__name__', prefill)}.hf")
    problem = hf.ops.META["problem"]
    if hf.ops is ops:
        raise ValueError("register(prefill=...): a package cannot take its own calls")
    if hf.ops.SPEC is None or not getattr(hf.ops.SPEC, "hf_prefill", False):
        raise ValueError(f"register(prefill=...): {hf.ops.NAMESPACE} is a {problem} kernel; "
                         "prompts need an sdpa or gqa one")
    return hf.attention_forward


def _mask_function() -> Any:
    """Returns the mask builder: SDPA's, except that a call with nothing to mask but causality
    gets None (is_causal covers it) also under torch.compile, where transformers' own SDPA
    builder always materialises the mask (its skip reads values a graph cannot); for the
    sliding_window and model problems, also None for a plain unpadded sliding window (the
    config's) the kernel computes.
    The rule is transformers' eager one: no padding mask, no mask pattern beyond causality,
    and as many keys as queries starting at key 0 (the same positions, so top-left causal).
    For the decode problem, a causal mask its kernel computes becomes the cache's lengths
    (decode.mask_lengths), which the attention layers take in its place."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    window = ops.SPEC is not None and ops.SPEC.hf_window
    lengths = ops.SPEC is not None and ops.SPEC.hf_lengths

    def mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
             kv_offset: int = 0, attention_mask: Any = None, local_size: Any = None,
             allow_is_causal_skip: bool = True, **kwargs: Any) -> Any:
        if lengths:
            if decode.is_lengths(attention_mask):   # made before a compiled forward by generate
                return attention_mask
            # a static cache's steps ask for a mask always (allow_is_causal_skip=False), so that
            # a compiled step sees one kind of mask; cache_seqlens is always one kind
            lens = decode.mask_lengths(
                batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask,
                (allow_is_causal_skip or isinstance(q_offset, torch.Tensor))
                and local_size is None
                and kwargs.get("mask_function", causal_mask_function) is causal_mask_function,
                kwargs.get("device"))
            if lens is not None:
                return lens
        # a local mask is the model's sliding window only where its config says so (a
        # chunked one, Llama 4's, has a local_size too, and no call argument the kernel reads)
        slides = window and local_size == getattr(kwargs.get("config"), "sliding_window", None)
        plain = (allow_is_causal_skip and attention_mask is None
                 and (local_size is None or slides)
                 and isinstance(kv_offset, int) and kv_offset == 0 and q_length == kv_length)
        if plain:
            return None
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                         q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                         local_size=local_size, allow_is_causal_skip=allow_is_causal_skip,
                         **kwargs)

    return mask


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, is_causal: bool | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Returns (attention output (B, S, H, D), None), as transformers' attention functions do."""
    return _attention(module, query, key, value, attention_mask, scaling, dropout,
                      sliding_window, is_causal, **kwargs)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
               dropout: float = 0.0, sliding_window: int | None = None,
               is_causal: bool | None = None, then: Any = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """attention_forward; a call the kernel does not take goes to `then` (another package's
    attention function) if given, else, counted, to transformers' SDPA path, or to the model's
    eager attention where the call passes a feature SDPA lacks (_hf_fallback)."""
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    reason = _refusal(module, query, key, attention_mask, dropout, kwargs)
    if reason is None:
        out = _through_op(module, query, key, value, attention_mask, scaling, sliding_window,
                          bool(is_causal), kwargs)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
        reason = f"{ops.META['problem']}: this call's pattern is not the kernel's"
    if decode.is_lengths(attention_mask):            # the mask the lengths stand for
        attention_mask = decode.visible(query, key, attention_mask)
    if then is not None:
        return then(module, query, key, value, attention_mask, scaling=scaling,
                    dropout=dropout, sliding_window=sliding_window, is_causal=is_causal,
                    **kwargs)
    beyond = _hf_fallback.passed(kwargs, _hf_fallback.BEYOND_SDPA)
    run = _hf_fallback.run_eager if beyond else _hf_fallback.run_sdpa
    if beyond:
        reason += f"; ran {_hf_fallback.eager_function(module)[1]}"
    ops.note_fallback(reason)
    return run(module, query, key, value, attention_mask, scaling, dropout, sliding_window,
               bool(is_causal), **kwargs)


def _refusal(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             attention_mask: Any, dropout: float, kwargs: dict[str, Any]) -> str | None:
    if ops.SPEC is None or ops.SPEC.fallback_for is None:
        return f"problem {ops.META['problem']} has no transformers mapping"
    takes = ops.SPEC.hf_kwargs
    unsupported = _hf_fallback.passed(kwargs, tuple(n for n in _UNSUPPORTED_KWARGS
                                                     if n not in takes))
    if unsupported:                       # named first: they decide where the call goes
        return f"{', '.join(unsupported)} passed (the kernel takes none)"
    if attention_mask is not None and not decode.is_lengths(attention_mask):
        return "an attention mask (padding or a pattern)"
    if dropout and module.training:
        return "dropout while training"
    if query.shape[2] != key.shape[2] and not ops.SPEC.hf_lengths:
        return "query and key lengths differ (decoding with a cache)"
    return None


def _through_op(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Any, scale: float | None, window: int | None, causal: bool,
                kwargs: dict[str, Any]) -> torch.Tensor | None:
    """Returns the op's output (B, H, S, D) for this problem, or None if it does not apply
    (the problem module's hf_call says which calls it serves; it gets the keyword arguments
    its spec's hf_kwargs names)."""
    if ops.SPEC.hf_call is None:
        return None
    return ops.SPEC.hf_call(ops.attention, q, k, v, mask, scale, window,
                            causal and q.shape[2] > 1,
                            **{n: kwargs.get(n) for n in ops.SPEC.hf_kwargs})
