"""Call keys: what a call's decision depends on (each tensor's shape, strides, dtype, device and
requires_grad; the other arguments' values), computed on every call, so kept short.

A problem's growing tensors (decode's cache) are keyed, while contiguous, by their length's
power of two: a generation decides once per doubling of its cache, not once per token.
"""
from __future__ import annotations

from typing import Any

import torch

from . import guard, problems
from ._meta import SPEC

_Tensor = torch.Tensor
GROWING = frozenset(i for i, p in enumerate(SPEC.params) if p.name in SPEC.growing) \
    if SPEC is not None else frozenset()
_TENSORS_AFTER_QKV = SPEC is None or any(p.is_tensor for p in SPEC.params[3:])


def meta(value: Any) -> Any:
    """Returns what a call key keeps of one argument."""
    if isinstance(value, torch.Tensor):
        return (type(value), value.shape, value.stride(), value.dtype, value.device,
                value.requires_grad)
    return value


def grown(value: Any) -> Any:
    """meta of a growing tensor: a contiguous one by its length's bit length (the rest of
    its shape exact), so that every length up to the next power of two shares one key."""
    if isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_contiguous():
        B, H, S, D = value.shape
        return (type(value), B, H, S.bit_length(), D, value.dtype, value.device,
                value.requires_grad)
    return meta(value)


def key(values: tuple[Any, ...]) -> tuple:
    """Returns the call key of the op's values (or a Python call's positional arguments)."""
    if not GROWING:
        if len(values) >= 3:
            q, k, v = values[0], values[1], values[2]
            if type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor:
                # the usual call, q, k, v first, spelled out: about half the host time of the
                # general form below (this key is computed on every call)
                rest = values[3:]
                if _TENSORS_AFTER_QKV:
                    rest = tuple(map(meta, rest))
                return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
                        q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
                        q.requires_grad, k.requires_grad, v.requires_grad) + rest
        return tuple(map(meta, values))
    lengths = {v.shape[2] for i, v in enumerate(values)
               if i in GROWING and isinstance(v, torch.Tensor) and v.dim() == 4}
    return tuple(grown(v) if i in GROWING else meta(v) for i, v in enumerate(values)) + \
        (len(lengths) <= 1,)                    # k and v of one length: the contract's case


def named_key(kwargs: dict[str, Any]) -> tuple:
    """Returns the key part of a Python call's keyword arguments."""
    items = tuple(kwargs.items())
    for _, v in items:
        if isinstance(v, _Tensor):
            return tuple((n, grown(v) if SPEC is not None and n in SPEC.growing else meta(v))
                         for n, v in items)
    return items                          # (name, value) pairs: what meta keeps of non-tensors


def grown_too_far(args: problems.Args) -> bool:
    """Whether a growing tensor would pass 2**31 elements before its key changes (a decision
    must hold for every length its key covers)."""
    for name in SPEC.growing if SPEC is not None else ():
        t = args.get(name)
        if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[2]:
            top = 2 ** t.shape[2].bit_length() - 1
            if t.numel() // t.shape[2] * top >= guard.INT32_ELEMENTS:
                return True
    return False
