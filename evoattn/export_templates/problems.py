"""The op's arguments per problem: its schema, shape rule, kernel call and SDPA fallback.

Each built-in problem the kernel was evolved for calls its entry point its own way; this
module says how, so ops.py can stay one generic function. Arguments travel as a dict
{name: value} in schema order. A user-defined problem gets its schema from the kernel's
entry signature (written into kernel.json by the exporter) and has no fallback.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

import torch
import torch.nn.functional as F

Args = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Param:
    """One argument of the op: its name, schema type and default (`required` when none)."""

    name: str
    type: str
    default: Any = None
    required: bool = True

    @property
    def is_tensor(self) -> bool:
        return self.type.startswith("Tensor")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """How the op of one problem is declared, checked, run on the kernel and on SDPA."""

    schema: str
    params: tuple[Param, ...]
    shape_refusal: Callable[[Args], str | None]   # why a call is outside the contract, or None
    call_kernel: Callable[[Callable[..., Any], Args], torch.Tensor]
    fallback: Callable[[Args], torch.Tensor] | None
    flags: Callable[[Args], dict[str, Any]]       # values checked against the verified sets

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
        """Returns the arguments by name, defaults filled in (TypeError like a Python call)."""
        if len(args) > len(self.params):
            raise TypeError(f"attention() takes {len(self.params)} arguments, got {len(args)}")
        out = dict(zip(self.names, args))
        for p in self.params[len(args):]:
            if p.name in kwargs:
                out[p.name] = kwargs.pop(p.name)
            elif p.required:
                raise TypeError(f"attention() missing required argument {p.name!r}")
            else:
                out[p.name] = p.default
        if kwargs:
            raise TypeError(f"attention() got unexpected arguments {', '.join(kwargs)}")
        return out


_PARAM = re.compile(r"^\s*(?P<type>[A-Za-z]+\??)\s+(?P<name>\w+)(?:\s*=\s*(?P<default>\S+))?\s*$")
_LITERALS = {"None": None, "True": True, "False": False}


def parse_schema(schema: str) -> tuple[Param, ...]:
    """Returns the parameters of a schema '(Tensor q, bool causal=False, ...) -> Tensor'."""
    inner = schema[schema.index("(") + 1: schema.rindex(")")]
    params = []
    for part in filter(None, (x.strip() for x in inner.split(","))):
        m = _PARAM.match(part)
        if m is None:
            raise ValueError(f"cannot read schema parameter {part!r} of {schema!r}")
        text = m["default"]
        if text is None:
            params.append(Param(m["name"], m["type"]))
        else:
            value = _LITERALS[text] if text in _LITERALS else (
                float(text) if any(c in text for c in ".eE") else int(text))
            params.append(Param(m["name"], m["type"], value, required=False))
    return tuple(params)


# ---- shared pieces --------------------------------------------------------------
def _scale(a: Args) -> float:
    return a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(a["q"].shape[-1])


def _same_shape(a: Args) -> str | None:
    q, k, v = a["q"], a["k"], a["v"]
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        return (f"q, k, v must share one (B, H, S, D) shape; got {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)}")
    return None


def _gqa_shapes(a: Args) -> str | None:
    q, k, v = a["q"], a["k"], a["v"]
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        return f"expected 4-D q and k, v of one shape; got {tuple(q.shape)}, {tuple(k.shape)}"
    same = (q.shape[0], q.shape[2], q.shape[3]) == (k.shape[0], k.shape[2], k.shape[3])
    if not same or q.shape[1] % k.shape[1]:
        return (f"k, v must be (B, Hkv, S, D) with Hq % Hkv == 0 for q (B, Hq, S, D); got "
                f"{tuple(q.shape)} and {tuple(k.shape)}")
    return None


def _masked_shapes(a: Args) -> str | None:
    q, k, v, mask = a["q"], a["k"], a["v"], a["mask"]
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or \
            (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        return f"expected q (B, H, Sq, D), k, v (B, H, Sk, D); got {tuple(q.shape)}, {tuple(k.shape)}"
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if mask.dim() != 4 or any(m not in (1, f) for m, f in zip(mask.shape, full)):
        return f"mask {tuple(mask.shape)} is not broadcastable to {full} dim by dim"
    if mask.dtype != q.dtype:
        return f"mask dtype {mask.dtype} differs from q's {q.dtype}"
    return None


def _window_shapes(param: str) -> Callable[[Args], str | None]:
    def refusal(a: Args) -> str | None:
        if a[param] < 1:
            return f"{param} must be >= 1, got {a[param]}"
        return _same_shape(a)
    return refusal


def _keep(S: int, device: torch.device, visible: Callable[[Any, Any], Any]) -> torch.Tensor:
    i = torch.arange(S, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    return visible(i, j)


def _sdpa_fallback(a: Args) -> torch.Tensor:
    return F.scaled_dot_product_attention(a["q"], a["k"], a["v"], is_causal=a["causal"],
                                          scale=a["scale"])


def _gqa_fallback(a: Args) -> torch.Tensor:
    return F.scaled_dot_product_attention(a["q"], a["k"], a["v"], is_causal=a["causal"],
                                          scale=a["scale"], enable_gqa=True)


def _window_fallback(a: Args) -> torch.Tensor:
    w = a["window"]
    keep = _keep(a["q"].shape[2], a["q"].device, lambda i, j: (j <= i) & (j > i - w))
    return F.scaled_dot_product_attention(a["q"], a["k"], a["v"], attn_mask=keep,
                                          scale=a["scale"])


def _strided_fallback(a: Args) -> torch.Tensor:
    s = a["stride"]
    keep = _keep(a["q"].shape[2], a["q"].device, lambda i, j: (j <= i) & (j % s == 0))
    return F.scaled_dot_product_attention(a["q"], a["k"], a["v"], attn_mask=keep,
                                          scale=a["scale"])


def _masked_fallback(a: Args) -> torch.Tensor:
    return F.scaled_dot_product_attention(a["q"], a["k"], a["v"], attn_mask=a["mask"],
                                          scale=a["scale"])


_CAUSAL = "(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None) -> Tensor"


def _causal_spec(shape_refusal: Callable[[Args], str | None],
                 fallback: Callable[[Args], torch.Tensor]) -> OpSpec:
    return OpSpec(
        schema=_CAUSAL, params=parse_schema(_CAUSAL), shape_refusal=shape_refusal,
        call_kernel=lambda fn, a: fn(a["q"], a["k"], a["v"], causal=a["causal"],
                                     scale=_scale(a)),
        fallback=fallback, flags=lambda a: {"causal": bool(a["causal"])})


def _param_spec(param: str, fallback: Callable[[Args], torch.Tensor]) -> OpSpec:
    schema = f"(Tensor q, Tensor k, Tensor v, int {param}, float? scale=None) -> Tensor"
    return OpSpec(
        schema=schema, params=parse_schema(schema), shape_refusal=_window_shapes(param),
        call_kernel=lambda fn, a: fn(a["q"], a["k"], a["v"], scale=_scale(a),
                                     **{param: a[param]}),
        fallback=fallback, flags=lambda a: {})


def _masked_spec() -> OpSpec:
    schema = "(Tensor q, Tensor k, Tensor v, Tensor mask, float? scale=None) -> Tensor"
    return OpSpec(
        schema=schema, params=parse_schema(schema), shape_refusal=_masked_shapes,
        call_kernel=lambda fn, a: fn(a["q"], a["k"], a["v"], a["mask"], scale=_scale(a)),
        fallback=_masked_fallback, flags=lambda a: {})


def _user_spec(schema: str) -> OpSpec:
    params = parse_schema(schema)
    return OpSpec(
        schema=schema, params=params, shape_refusal=lambda a: None,
        call_kernel=lambda fn, a: fn(*(a[p.name] for p in params)),
        fallback=None, flags=lambda a: {})


def spec_for(meta: dict[str, Any]) -> OpSpec | None:
    """Returns the op spec of an export's problem (None: the problem has no op form)."""
    problem = meta["problem"]
    if meta["user_problem"]:
        return _user_spec(meta["schema"]) if meta["schema"] else None
    if problem == "sdpa":
        return _causal_spec(_same_shape, _sdpa_fallback)
    if problem == "gqa":
        return _causal_spec(_gqa_shapes, _gqa_fallback)
    if problem == "sliding_window":
        return _param_spec("window", _window_fallback)
    if problem == "strided":
        return _param_spec("stride", _strided_fallback)
    if problem == "masked":
        return _masked_spec()
    if problem == "decode":
        from .decode import spec
        return spec()
    return None
