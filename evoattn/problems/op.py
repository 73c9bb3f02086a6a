"""What an exported op needs of a problem: its schema, shape rule, kernel call, SDPA fallback
and transformers route, as one OpSpec; and the pieces problem modules build theirs from.

Each built-in problem module's `op_spec()` returns its OpSpec, so the package's ops.py can stay
one generic function. Arguments are checked as a dict {name: value} (once per call key) and
run as values in schema order (every call). A user-defined problem gets its schema from the
kernel's entry signature (written into kernel.json by the exporter) and has no fallback.
This module is shipped into every exported package: it imports torch and nothing else.
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
    # The transformers route (hf.py): (attention, q, k, v, mask, scale, window, causal) -> the
    # op's output (B, H, S, D) for a call the problem serves, else None; None: no mapping.
    hf_call: Callable[..., torch.Tensor | None] | None = None
    hf_prefill: bool = False      # serves a prompt's causal calls (another package's prompts)
    hf_window: bool = False       # computes the model's sliding window (no mask built for it)
    hf_lengths: bool = False      # takes a cache's lengths in place of a mask (decode)
    # transformers' keyword arguments hf_call reads (passed to it by name, None where a call
    # has none): features the kernel computes, which hf.py then does not refuse
    hf_kwargs: tuple[str, ...] = ()

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


# ---- pieces the problem modules build their specs from ------------------------------
def same_shape(a: Args) -> str | None:
    """Returns why q, k, v do not share one (B, H, S, D) shape, or None."""
    q, k, v = a["q"], a["k"], a["v"]
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        return (f"q, k, v must share one (B, H, S, D) shape; got {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)}")
    return None


def gqa_shapes(a: Args) -> str | None:
    """Returns why q (B, Hq, S, D) and k, v (B, Hkv, S, D) are not a GQA call, or None."""
    q, k, v = a["q"], a["k"], a["v"]
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        return f"expected 4-D q and k, v of one shape; got {tuple(q.shape)}, {tuple(k.shape)}"
    same = (q.shape[0], q.shape[2], q.shape[3]) == (k.shape[0], k.shape[2], k.shape[3])
    if not same or q.shape[1] % k.shape[1]:
        return (f"k, v must be (B, Hkv, S, D) with Hq % Hkv == 0 for q (B, Hq, S, D); got "
                f"{tuple(q.shape)} and {tuple(k.shape)}")
    return None


def keep_mask(S: int, device: torch.device, visible: Callable[[Any, Any], Any]) -> torch.Tensor:
    """Returns the (S, S) boolean mask visible(i, j) of query i and key j."""
    i = torch.arange(S, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    return visible(i, j)


def scale_of(q: torch.Tensor, scale: float | None) -> float:
    """Returns the scale a call asks for, 1/sqrt(D) where it asks for none."""
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


# The fallbacks of the causal problems: PyTorch SDPA, with the op's own parameters.
def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
         scale: float | None = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
             scale: float | None = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                          enable_gqa=True)


def gqa_aware(a: Args) -> Callable[..., torch.Tensor]:
    """SDPA, told about GQA only when k, v have fewer heads (the flag narrows its backends)."""
    return sdpa_gqa if a["k"].shape[1] != a["q"].shape[1] else sdpa


def direct_sdpa(fallback: Callable[..., torch.Tensor], a: Args
                ) -> tuple[Callable[..., torch.Tensor], tuple, tuple[str, ...]] | None:
    """sdpa or sdpa_gqa as one SDPA call: attn_mask, dropout_p and is_causal positional,
    scale and enable_gqa (keyword-only) by name where they are not SDPA's defaults."""
    if fallback is not sdpa and fallback is not sdpa_gqa:
        return None
    named = {"scale": a.get("scale"), "enable_gqa": fallback is sdpa_gqa}
    named = {n: x for n, x in named.items() if x is not None and x is not False}
    return (F.scaled_dot_product_attention, (None, 0.0, a.get("causal", False), *named.values()),
            tuple(named))


def sdpa_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """Returns SDPA with an explicit mask (boolean: True is visible; float: added)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Returns k or v with each of its heads repeated to `heads` (a no-op without GQA)."""
    B, Hkv, S, D = x.shape
    if Hkv == heads:
        return x
    return x[:, :, None].expand(B, Hkv, heads // Hkv, S, D).reshape(B, heads, S, D)


CAUSAL_SCHEMA = "(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None) -> Tensor"


def causal_spec(repeats_kv: bool) -> OpSpec:
    """Returns the spec of a causal-or-not attention op (sdpa, gqa): SDPA falls back."""
    return OpSpec(
        schema=CAUSAL_SCHEMA, params=parse_schema(CAUSAL_SCHEMA), shape_refusal=gqa_shapes,
        call_kernel=lambda fn, q, k, v, causal=False, scale=None: fn(
            q, k, v, causal=causal, scale=scale_of(q, scale)),
        fallback_for=gqa_aware, flags=lambda a: {"causal": bool(a["causal"])},
        repeats_kv=repeats_kv, direct=direct_sdpa,
        # positional: the shortest call key
        hf_call=lambda attention, q, k, v, mask, scale, window, causal: attention(
            q, k, v, causal, scale),
        hf_prefill=True)


def param_spec(param: str, fallback: Callable[..., torch.Tensor], **hf: Any) -> OpSpec:
    """Returns the spec of an op (q, k, v, int <param>, scale) whose fallback is given."""
    schema = f"(Tensor q, Tensor k, Tensor v, int {param}, float? scale=None) -> Tensor"

    def refusal(a: Args) -> str | None:
        if a[param] < 1:
            return f"{param} must be >= 1, got {a[param]}"
        return same_shape(a)

    return OpSpec(
        schema=schema, params=parse_schema(schema), shape_refusal=refusal,
        call_kernel=lambda fn, q, k, v, value, scale=None: fn(
            q, k, v, scale=scale_of(q, scale), **{param: value}),
        fallback_for=lambda a: fallback, flags=lambda a: {}, **hf)


def user_spec(schema: str) -> OpSpec:
    """Returns the spec of a user problem's op: its schema, no shape rule, no fallback."""
    return OpSpec(
        schema=schema, params=parse_schema(schema), shape_refusal=lambda a: None,
        call_kernel=lambda fn, *values: fn(*values), fallback_for=None, flags=lambda a: {})
