"""Where a transformers call the kernel does not take goes: transformers' SDPA path, or, for a
call passing a feature SDPA lacks (logit softcapping, attention sinks, attention weights to
return), the model's own eager attention, which has every feature its model passes.

Keyword arguments are read by identity (`is None`, `is False`), never truth-tested: a sinks
tensor (GPT-OSS's `s_aux`) has no truth value.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

# Keyword arguments that SDPA's path refuses or drops, and the model's eager attention keeps.
BEYOND_SDPA = ("softcap", "s_aux", "sinks", "output_attentions")


def passed(kwargs: dict[str, Any], names: tuple[str, ...]) -> tuple[str, ...]:
    """Returns the names among `names` that a call passes with a value (not None, not False)."""
    return tuple(n for n in names if kwargs.get(n) is not None and kwargs.get(n) is not False)


def eager_function(module: torch.nn.Module) -> tuple[Callable[..., Any], str]:
    """Returns the eager attention function of the model `module` belongs to, and its name:
    its modeling module's `eager_attention_forward`, else transformers' FlexAttention."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if callable(eager):
        return eager, "the model's eager attention"
    from transformers.integrations.flex_attention import flex_attention_forward
    return flex_attention_forward, "FlexAttention"


def eager_mask(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
               causal: bool, window: int | None) -> torch.Tensor | None:
    """Returns the additive mask an eager attention function takes, for a mask this package's
    mask function made: None stands for causality alone (with the layer's window, which the
    sliding_window problem's mask leaves to the kernel), a boolean mask for what is kept."""
    if mask is None:
        Sq, Sk = query.shape[2], key.shape[2]
        if not causal or Sq == 1 and window is None:
            return None
        i = torch.arange(Sq, device=query.device)[:, None] + (Sk - Sq)   # bottom-right
        j = torch.arange(Sk, device=query.device)[None, :]
        keep = j <= i
        if window is not None:
            keep = keep & (j > i - window)
        mask = keep[None, None]
    if mask.dtype == torch.bool:
        low = torch.finfo(query.dtype).min     # transformers' eager masks: no -inf, no NaN rows
        return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, low)
    return mask


def run_eager(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, mask: torch.Tensor | None, scaling: float | None,
              dropout: float, sliding_window: int | None, causal: bool,
              **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Runs the model's eager attention on one call (see eager_function)."""
    fn, _ = eager_function(module)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    return fn(module, query, key, value, eager_mask(query, key, mask, causal, sliding_window),
              dropout=dropout, scaling=scaling, sliding_window=sliding_window, **kwargs)


def run_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, mask: Any, scaling: float | None, dropout: float,
             sliding_window: int | None, causal: bool, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Runs transformers' SDPA path on one call."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                  scaling=scaling, is_causal=causal,
                                  sliding_window=sliding_window, **kwargs)
