"""The op's arguments per problem: its schema, shape rule, kernel call and SDPA fallback.

Each built-in problem the kernel was evolved for calls its entry point its own way; this
module says how, so ops.py can stay one generic function. Arguments are checked as a dict
{name: value} (once per call key) and run as values in schema order (every call). A
user-defined problem gets its schema from the kernel's entry signature (written into
kernel.json by the exporter) and has no fallback.
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
    """How the op of one problem is declared, checked, run on the kernel and on SDPA.

    `call_kernel(fn, *values)` and the functions `fallback_for` returns take the op's arguments
    in schema order (the fallback also by name, as a Python call of the op passes them)."""

    schema: str
    params: tuple[Param, ...]
    shape_refusal: Callable[[Args], str | None]   # why a call is outside the contract, or None
    call_kernel: Callable[..., torch.Tensor]
    fallback_for: Callable[[Args], Callable[..., torch.Tensor]] | None   # SDPA for such a call
    flags: Callable[[Args], dict[str, Any]]       # values checked against the verified sets
    repeats_kv: bool = False      # the kernel's contract has k, v with q's heads: GQA repeats
    # Tensors whose dim 2 grows call after call (a generation's cache): one decision serves
    # every length up to the next power of two while they stay contiguous (see ops.py).
    growing: tuple[str, ...] = ()
    # (fallback, a call's arguments) -> (fn, values, names) with fallback(q, k, v, ...) equal
    # to fn(q, k, v, *values) for that call, the last len(names) values passed by those names,
    # where the problem has such an fn: attention()'s eager fallback then calls fn itself,
    # with no Python frame between (ops._Direct)
    direct: Callable[[Callable[..., torch.Tensor], Args],
                     tuple[Callable[..., torch.Tensor], tuple, tuple[str, ...]] | None] = \
        lambda fallback, args: None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def leading_tensors(self) -> int:
        """How many parameters, from the first, are tensors (q, k, v: 3)."""
        n = 0
        while n < len(self.params) and self.params[n].is_tensor:
            n += 1
        return n

    def trim(self, values: tuple[Any, ...]) -> tuple[Any, ...]:
        """Returns the values without trailing defaults, as PyTorch's dispatcher hands them to
        the op (so that a call and its dispatched form share one call key)."""
        n = len(values)
        while n and not self.params[n - 1].required and not isinstance(values[n - 1], torch.Tensor) \
                and type(values[n - 1]) is type(self.params[n - 1].default) \
                and values[n - 1] == self.params[n - 1].default:
            n -= 1
        return values[:n]

    def layout_needs(self, args: Args) -> frozenset[str]:
        """Returns what a call asks of the kernel beyond its contract's dense inputs: "strided"
        (a tensor that is not contiguous), "gqa" (k, v with fewer heads than q, to repeat)."""
        tensors = [args[p.name] for p in self.params if p.is_tensor and args[p.name] is not None]
        needs = set()
        if any(not t.is_contiguous() for t in tensors):
            needs.add("strided")
        if self.repeats_kv and args["k"].shape[1] != args["q"].shape[1]:
            needs.add("gqa")
        return frozenset(needs)

    def dense(self, values: tuple[Any, ...]) -> tuple[Any, ...]:
        """Returns the arguments as the contract has them: contiguous, k and v repeated to q's
        heads (each kv head serving H // Hkv consecutive query heads)."""
        out = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in values]
        if self.repeats_kv:
            q, k, v = out[:3]
            if k.shape[1] != q.shape[1]:
                group = q.shape[1] // k.shape[1]
                out[1], out[2] = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return tuple(out)

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


# The fallbacks: PyTorch SDPA, with the op's own parameters (names and defaults).
def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
          scale: float | None = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                          enable_gqa=True)


def _gqa_aware(a: Args) -> Callable[..., torch.Tensor]:
    """SDPA, told about GQA only when k, v have fewer heads (the flag narrows its backends)."""
    return _sdpa_gqa if a["k"].shape[1] != a["q"].shape[1] else _sdpa


def _direct_sdpa(fallback: Callable[..., torch.Tensor], a: Args
                 ) -> tuple[Callable[..., torch.Tensor], tuple, tuple[str, ...]] | None:
    """_sdpa or _sdpa_gqa as one SDPA call: attn_mask, dropout_p and is_causal positional,
    scale and enable_gqa (keyword-only) by name where they are not SDPA's defaults."""
    if fallback is not _sdpa and fallback is not _sdpa_gqa:
        return None
    named = {"scale": a.get("scale"), "enable_gqa": fallback is _sdpa_gqa}
    named = {n: x for n, x in named.items() if x is not None and x is not False}
    return (F.scaled_dot_product_attention, (None, 0.0, a.get("causal", False), *named.values()),
            tuple(named))


def _window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
            scale: float | None = None) -> torch.Tensor:
    keep = _keep(q.shape[2], q.device, lambda i, j: (j <= i) & (j > i - window))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)


def _strided(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stride: int,
             scale: float | None = None) -> torch.Tensor:
    keep = _keep(q.shape[2], q.device, lambda i, j: (j <= i) & (j % stride == 0))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float | None = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _scale_of(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


_CAUSAL = "(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None) -> Tensor"


def _causal_spec(repeats_kv: bool) -> OpSpec:
    return OpSpec(
        schema=_CAUSAL, params=parse_schema(_CAUSAL), shape_refusal=_gqa_shapes,
        call_kernel=lambda fn, q, k, v, causal=False, scale=None: fn(
            q, k, v, causal=causal, scale=_scale_of(q, scale)),
        fallback_for=_gqa_aware, flags=lambda a: {"causal": bool(a["causal"])},
        repeats_kv=repeats_kv, direct=_direct_sdpa)


def _param_spec(param: str, fallback: Callable[..., torch.Tensor]) -> OpSpec:
    schema = f"(Tensor q, Tensor k, Tensor v, int {param}, float? scale=None) -> Tensor"
    return OpSpec(
        schema=schema, params=parse_schema(schema), shape_refusal=_window_shapes(param),
        call_kernel=lambda fn, q, k, v, value, scale=None: fn(
            q, k, v, scale=_scale_of(q, scale), **{param: value}),
        fallback_for=lambda a: fallback, flags=lambda a: {})


def _masked_spec() -> OpSpec:
    schema = "(Tensor q, Tensor k, Tensor v, Tensor mask, float? scale=None) -> Tensor"
    return OpSpec(
        schema=schema, params=parse_schema(schema), shape_refusal=_masked_shapes,
        call_kernel=lambda fn, q, k, v, mask, scale=None: fn(q, k, v, mask,
                                                             scale=_scale_of(q, scale)),
        fallback_for=lambda a: _masked, flags=lambda a: {})


def _user_spec(schema: str) -> OpSpec:
    return OpSpec(
        schema=schema, params=parse_schema(schema), shape_refusal=lambda a: None,
        call_kernel=lambda fn, *values: fn(*values), fallback_for=None, flags=lambda a: {})


def spec_for(meta: dict[str, Any]) -> OpSpec | None:
    """Returns the op spec of an export's problem (None: the problem has no op form)."""
    problem = meta["problem"]
    if meta["user_problem"]:
        return _user_spec(meta["schema"]) if meta["schema"] else None
    if problem == "sdpa":             # GQA calls too: repeated for a kernel that needs it
        return _causal_spec(repeats_kv=True)
    if problem == "gqa":
        return _causal_spec(repeats_kv=False)
    if problem == "sliding_window":
        return _param_spec("window", _window)
    if problem == "strided":
        return _param_spec("stride", _strided)
    if problem == "masked":
        return _masked_spec()
    if problem == "decode":
        from .decode import spec
        return spec()
    return None
