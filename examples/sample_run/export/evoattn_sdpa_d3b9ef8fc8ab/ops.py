"""The kernel as a PyTorch custom op: `torch.ops.<namespace>.attention`, with a fake for compile.

Dynamo and CUDA graphs see one opaque op whose output is a new contiguous tensor shaped like q
(an eager `attention()` call returns the kernel's output as the kernel lays it out: see
_kernel_run). What a call runs is decided once per call key (each tensor's shape, strides,
dtype, device and requires_grad; the other arguments' values) and kept, so a repeated call
costs a dict lookup: the evolved kernel on what the guard says it was verified on, PyTorch SDPA
elsewhere (logged once per reason at debug level on this package's logger). A problem's growing
tensors (decode's cache) are keyed, while contiguous, by their length's power of two: a
generation decides once per doubling of its cache, not once per token. A kernel whose module
takes a layout (its INPUT_LAYOUTS: "strided", any strides; "gqa", k and v with fewer heads)
gets such inputs as they lie once it has given, on the first call of that key, what it gives on
contiguous copies; other kernels get the copies.

`attention()`, called eagerly, decides before the op and skips PyTorch's dispatcher (tens of
microseconds for an op implemented in Python); its per-call work (key, lookup, call) runs in
C++ once _native has built _callkey.cpp (in the background, from the first call; see
call_path()), in Python until then: a call that falls back runs SDPA directly, a
call on plain tensors with no dispatch or function mode active runs what the op would run
(from a key's second call, what the kernel module's `prepare` returned for that key, where the
kernel takes the inputs as they lie: the evaluator checked and timed the kernel so). Under
torch.compile, and under such modes, it goes through the op, which decides per call at run
time. `stats()` counts both kinds of call; a CUDA graph replay runs no Python, so replays are
not counted.

`use_kernel(False)` (or `with kernel_off():`) makes every call fall back, counted with the
reason "kernel switched off", so that a model can be timed with everything but the kernel
unchanged; each setting keeps its own decisions, so switching back and forth (a benchmark's
interleaved rounds) decides nothing twice. Compiled graphs follow it (the op
decides when it runs); a CUDA graph replays what it captured.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch

from . import _loader, _native, guard, problems

META: dict[str, Any] = json.loads((Path(__file__).resolve().parent / "kernel.json").read_text())
NAMESPACE: str = META["namespace"]
SPEC = problems.spec_for(META)
log = logging.getLogger(META["package"])
MAX_DECISIONS = 4096                   # per table; a full table starts again empty
KERNEL_OFF = "kernel switched off"

_kernel_enabled = True

_counts = {"kernel": 0}
_reasons: dict[str, list[int]] = {}    # a fallback's reason: [its calls] (a cell an entry holds)
_logged: set[str] = set()


class Decision(NamedTuple):
    """What the op runs for one call key."""

    run: Callable[..., torch.Tensor]                 # takes the op's values in schema order
    fallback: Callable[..., torch.Tensor] | None     # SDPA, when the call falls back
    reason: str | None                               # why it falls back
    eager: Callable[..., torch.Tensor] | None = None  # attention()'s run (see _kernel_run)
    prepare: Callable[..., Any] | None = None        # the kernel's, where it takes the inputs


# Per kernel setting (see use_kernel): the op's decisions and attention()'s entries, by call key.
_TABLES: dict[bool, tuple[dict, dict]] = {True: ({}, {}), False: ({}, {})}
_decisions: dict[tuple, Decision] = _TABLES[True][0]
_entries: dict[tuple, Callable[..., torch.Tensor]] = _TABLES[True][1]


def stats() -> dict[str, Any]:
    """Returns how many calls ran the kernel and how many fell back, with the reasons.

    Under torch.compile the op's own calls are counted as they run; a call that Python code
    around the op sends elsewhere (the Hugging Face integration's refusals, inputs that need
    grad) is decided once when the graph is traced and is not counted per call: counting it
    would make the count a constant of the graph, and every call a recompile."""
    reasons = {r: cell[0] for r, cell in _reasons.items() if cell[0]}
    return {"kernel": _counts["kernel"], "fallback": sum(reasons.values()),
            "fallback_reasons": reasons}


def reset_stats() -> None:
    """Sets the call counts back to zero."""
    _counts["kernel"] = 0
    for cell in _reasons.values():            # entries hold their cells: zero them in place
        cell[0] = 0


def _reason_cell(reason: str) -> list[int]:
    """Returns the one-element list that counts the calls falling back for `reason`."""
    return _reasons.setdefault(reason, [0])


def note_fallback(reason: str) -> None:
    """Counts one call that ran PyTorch instead; logs the reason the first time it is seen."""
    if torch.compiler.is_compiling():
        return
    _reason_cell(reason)[0] += 1
    _log_once(reason)


def _log_once(reason: str, warning: bool = False) -> None:
    if reason not in _logged:
        _logged.add(reason)
        if warning:
            log.warning("%s: %s; running PyTorch SDPA instead", NAMESPACE, reason)
        else:
            log.debug("%s: falling back to PyTorch SDPA: %s", NAMESPACE, reason)


def use_kernel(enabled: bool) -> None:
    """Turns the kernel on or off (off: every call runs the fallback, counted as KERNEL_OFF).
    Each setting has its own decisions: none made under one is used under the other."""
    global _kernel_enabled, _decisions, _entries
    _kernel_enabled = bool(enabled)
    _decisions, _entries = _TABLES[_kernel_enabled]


def kernel_enabled() -> bool:
    """Returns whether the kernel may run (see use_kernel)."""
    return _kernel_enabled


@contextlib.contextmanager
def kernel_off() -> Iterator[None]:
    """Runs the block with the kernel switched off; restores the previous setting after."""
    was = _kernel_enabled
    use_kernel(False)
    try:
        yield
    finally:
        use_kernel(was)


def _meta(value: Any) -> Any:
    """Returns what a call key keeps of one argument."""
    if isinstance(value, torch.Tensor):
        return (type(value), value.shape, value.stride(), value.dtype, value.device,
                value.requires_grad)
    return value


def _grown(value: Any) -> Any:
    """_meta of a growing tensor: a contiguous one by its length's bit length (the rest of
    its shape exact), so that every length up to the next power of two shares one key."""
    if isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_contiguous():
        B, H, S, D = value.shape
        return (type(value), B, H, S.bit_length(), D, value.dtype, value.device,
                value.requires_grad)
    return _meta(value)


_GROWING = frozenset(i for i, p in enumerate(SPEC.params) if p.name in SPEC.growing) \
    if SPEC is not None else frozenset()


_Tensor = torch.Tensor
_TENSORS_AFTER_QKV = SPEC is None or any(p.is_tensor for p in SPEC.params[3:])


def _key(values: tuple[Any, ...]) -> tuple:
    """Returns the call key of the op's values (or a Python call's positional arguments)."""
    if not _GROWING:
        if len(values) >= 3:
            q, k, v = values[0], values[1], values[2]
            if type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor:
                # the usual call, q, k, v first, spelled out: about half the host time of the
                # general form below (this key is computed on every call)
                rest = values[3:]
                if _TENSORS_AFTER_QKV:
                    rest = tuple(map(_meta, rest))
                return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
                        q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
                        q.requires_grad, k.requires_grad, v.requires_grad) + rest
        return tuple(map(_meta, values))
    lengths = {v.shape[2] for i, v in enumerate(values)
               if i in _GROWING and isinstance(v, torch.Tensor) and v.dim() == 4}
    return tuple(_grown(v) if i in _GROWING else _meta(v) for i, v in enumerate(values)) + \
        (len(lengths) <= 1,)                    # k and v of one length: the contract's case


def _named_key(kwargs: dict[str, Any]) -> tuple:
    items = tuple(kwargs.items())
    for _, v in items:
        if isinstance(v, _Tensor):
            return tuple((n, _grown(v) if SPEC is not None and n in SPEC.growing else _meta(v))
                         for n, v in items)
    return items                          # (name, value) pairs: what _meta keeps of non-tensors


def _grown_too_far(args: problems.Args) -> bool:
    """Whether a growing tensor would pass 2**31 elements before its key changes (a decision
    must hold for every length its key covers)."""
    for name in SPEC.growing if SPEC is not None else ():
        t = args.get(name)
        if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[2]:
            top = 2 ** t.shape[2].bit_length() - 1
            if t.numel() // t.shape[2] * top >= guard.INT32_ELEMENTS:
                return True
    return False


def _remember(table: dict, key: tuple, value: Any) -> Any:
    if len(table) >= MAX_DECISIONS:
        table.clear()
    table[key] = value
    return value


# ---- the op: what it runs per call key ---------------------------------------------
def _run(*values: Any) -> torch.Tensor:
    """The op's implementation: runs one call as its key's decision says."""
    key = _key(values)
    decision = _decisions.get(key)
    if decision is None:
        decision = _decide(values, key)
    return decision.run(*values)


def _decide(values: tuple[Any, ...], key: tuple) -> Decision:
    """Decides what a call key runs (the guard's checks, the kernel's load, a layout check)
    and remembers it."""
    assert SPEC is not None
    args = SPEC.bind(values, {})              # the dispatcher leaves trailing defaults out
    reason = guard.refusal(META["verified"], SPEC, args) if _kernel_enabled else KERNEL_OFF
    kernel = None
    if reason is None:
        try:
            first = next(args[p.name] for p in SPEC.params if p.is_tensor)
            kernel = _loader.kernel(META, first.device)
        except _loader.KernelUnavailable as e:
            reason = f"kernel unavailable: {e}"
            _log_once(reason, warning=True)
    if kernel is None:
        _log_once(str(reason))
        if SPEC.fallback_for is None:
            return _remember(_decisions, key, Decision(_refuse(str(reason)), None, reason))
        fallback = SPEC.fallback_for(args)
        return _remember(_decisions, key, Decision(_counted(str(reason), fallback, True),
                                                   fallback, reason))
    direct = _takes_as_given(kernel, args, values)
    run, eager = _kernel_run(kernel.fn, direct is True)
    # a growing key covers many shapes, more than prepare() is asked to hold for
    decision = Decision(run, None, None, eager,
                        kernel.prepare if direct is True and not _GROWING else None)
    return decision if direct is None else _remember(_decisions, key, decision)


def _takes_as_given(kernel: _loader.Kernel, args: problems.Args,
                    values: tuple[Any, ...]) -> bool | None:
    """Returns whether the kernel gets these inputs as they lie: True for the contract's dense
    layout; for another, whether the kernel declares it and gives on it what it gives on
    contiguous copies (within a few units of rounding); None while a CUDA graph is being
    captured (nothing may synchronise then: copies this time, the check on a later call)."""
    assert SPEC is not None
    needs = SPEC.layout_needs(args)
    if not needs:
        return True
    if not needs <= kernel.layouts:
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    given = SPEC.call_kernel(kernel.fn, *values)
    dense = SPEC.call_kernel(kernel.fn, *SPEC.dense(values))
    tol = 4 * torch.finfo(dense.dtype).eps if dense.dtype.is_floating_point else 0
    return given.shape == dense.shape and torch.allclose(
        given.float(), dense.float(), rtol=tol, atol=tol, equal_nan=True)


def _kernel_run(fn: Callable[..., Any], direct: bool
                ) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """Returns what runs the kernel: on the inputs as they are, or on dense copies (tensors
    come positionally; other arguments may come by name, as a Python call passes them), for
    the op (its output contiguous, as the fake says) and for attention()'s eager calls (the
    kernel's output as it comes: the default seed lays it out as q, as SDPA does, so that
    transformers transposes its (B, S, H, D) views back without a copy)."""
    call, dense = SPEC.call_kernel, SPEC.dense

    if direct:
        def run(*values: Any, **named: Any) -> torch.Tensor:
            _counts["kernel"] += 1
            return call(fn, *values, **named).contiguous()

        def eager(*values: Any, **named: Any) -> torch.Tensor:
            _counts["kernel"] += 1
            return call(fn, *values, **named)
    else:
        def run(*values: Any, **named: Any) -> torch.Tensor:
            _counts["kernel"] += 1
            return call(fn, *dense(values), **named).contiguous()

        def eager(*values: Any, **named: Any) -> torch.Tensor:
            _counts["kernel"] += 1
            return call(fn, *dense(values), **named)
    return run, eager


def _counted(reason: str, fallback: Callable[..., torch.Tensor], contiguous: bool,
             args: tuple[Any, ...] = (), bound: problems.Args | None = None
             ) -> Callable[..., torch.Tensor]:
    """Returns the fallback, counting each call (the op's output is contiguous, like its fake).
    Given the call's positional args and bound arguments, where the problem calls its fallback
    directly (OpSpec.direct) and the call passes q, k, v first: a _Direct."""
    cell = _reason_cell(reason)
    if not contiguous:
        direct = SPEC.direct(fallback, bound) if SPEC is not None and bound else None
        if direct is not None:
            fn, values, names = direct
            n = SPEC.leading_tensors
            if len(args) >= n and all(isinstance(x, torch.Tensor) for x in args[:n]):
                return _Direct((cell, fn, n, values, names))

        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            cell[0] += 1
            return fallback(*args, **kwargs)
        return run

    def run_contiguous(*args: Any, **kwargs: Any) -> torch.Tensor:
        cell[0] += 1
        return fallback(*args, **kwargs).contiguous()
    return run_contiguous


class _Direct(tuple):
    """A counted fallback for one call key: (cell, fn, n, values, names) runs cell[0] += 1,
    then fn on the call's n leading tensors and the values its key fixes, the last
    len(names) of them by those names. _callkey.cpp makes the same call without entering
    Python (any tuple entry is one)."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        cell, fn, n, values, names = self
        cell[0] += 1
        if not names:
            return fn(*args[:n], *values)
        k = len(values) - len(names)
        return fn(*args[:n], *values[:k], **dict(zip(names, values[k:])))


def _refuse(reason: str) -> Callable[..., torch.Tensor]:
    def run(*values: Any) -> torch.Tensor:
        raise NotImplementedError(f"{NAMESPACE}.attention: {reason}, and this problem has "
                                  "no PyTorch fallback")
    return run


def _fake(*values: Any, **named: Any) -> torch.Tensor:
    q = values[0] if values else named[SPEC.names[0]]
    return q.new_empty(q.shape)        # contiguous, like every real output


op = None
if SPEC is not None:
    op = torch.library.custom_op(f"{NAMESPACE}::attention", _run, mutates_args=(),
                                 schema=SPEC.schema)
    op.register_fake(_fake)
    # Called through torch.ops (C++ dispatch): a few µs a call, where calling `op` itself goes
    # through Python wrappers that cost several times that.
    _dispatch = getattr(torch.ops, NAMESPACE).attention


# ---- the Python entry ----------------------------------------------------------------
_is_compiling, _grad_enabled = torch.compiler.is_compiling, torch.is_grad_enabled


_native_call: Callable[..., torch.Tensor] | None = None  # _callkey's call, once loaded
_native_wanted = not _GROWING and SPEC is not None       # growing keys are the Python key's


def attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Runs one call, like SDPA: the kernel through the op where it may run, SDPA directly
    elsewhere; inputs that need gradients take differentiable SDPA (the kernel is
    forward-only)."""
    if _is_compiling():
        return _traced(args, kwargs)
    if _native_call is not None:          # the same key, lookup and call in C++ (_native)
        return _native_call(_entries, _miss, args, kwargs)
    if _native_wanted:
        _start_native()
    key = (_key(args), _named_key(kwargs) if kwargs else (), _grad_enabled())
    entry = _entries.get(key)
    if entry is None:
        entry = _entry_for(args, kwargs, key)
    return entry(*args, **kwargs)


def _miss(args: tuple[Any, ...], kwargs: dict[str, Any], key: tuple | None
          ) -> Callable[..., torch.Tensor]:
    """The C++ path's miss: the entry for `key`, or for the Python key where C++ formed none
    (tensor subclasses, tensors by name)."""
    if key is None:
        key = (_key(args), _named_key(kwargs) if kwargs else (), _grad_enabled())
        entry = _entries.get(key)
        if entry is not None:
            return entry
    return _entry_for(args, kwargs, key)


def _start_native() -> None:
    global _native_wanted
    _native_wanted = False
    _native.start(_set_native)


def _set_native(call: Callable[..., torch.Tensor]) -> None:
    global _native_call
    _native_call = call


def _after_fork_in_child() -> None:
    global _native_wanted
    _native_wanted = _native_call is None and not _GROWING and SPEC is not None


if hasattr(os, "register_at_fork"):        # POSIX only
    os.register_at_fork(after_in_child=_after_fork_in_child)


def call_path(wait_s: float | None = 0.0) -> str:
    """Which path attention() takes per eager call: 'native' (the key, lookup and call in
    C++), 'building' (the C++ path is being built; Python meanwhile), 'not started' (no call
    yet) or 'python (<why>)'. With wait_s (None: no limit), starts the build if no call has,
    and waits that long for it to finish."""
    if SPEC is None or _GROWING:
        return "python (this problem's calls are keyed in Python)"
    if wait_s != 0.0:
        if _native_wanted:
            _start_native()
        _native.wait(wait_s)
    return _native.status()


def _entry_for(args: tuple[Any, ...], kwargs: dict[str, Any],
               entry_key: tuple) -> Callable[..., torch.Tensor]:
    """Returns what attention() runs for calls like this one (the op's run without the
    dispatcher, the op, or a counted SDPA), remembered under entry_key once the op's own
    decision is."""
    if SPEC is None:
        raise NotImplementedError(f"problem {META['problem']} has no attention op; "
                                  "see load_kernel_module()")
    bound = SPEC.bind(args, dict(kwargs))
    if SPEC.fallback_for is not None and _needs_grad(bound):
        reason = "inputs require grad (the kernel is forward-only)"
        _log_once(reason)
        return _remember(_entries, entry_key,
                         _counted(reason, SPEC.fallback_for(bound), False, args, bound))
    values = SPEC.trim(tuple(bound.values()))   # as the op will get them: the same key
    key = _key(values)
    decision = _decisions.get(key) or _decide(values, key)
    if key not in _decisions:                   # decided for this call only (see _decide)
        return _dispatch
    if decision.fallback is not None:
        return _remember(_entries, entry_key, _counted(str(decision.reason), decision.fallback,
                                                       False, args, bound))
    tensors_positional = all(not isinstance(v, torch.Tensor) for v in kwargs.values())
    # A refusal to raise, tensors passed by name, tensor subclasses: the op handles them.
    if decision.reason is not None or not tensors_positional or \
            any(type(v) is not torch.Tensor for v in values if isinstance(v, torch.Tensor)):
        return _remember(_entries, entry_key, _dispatch)
    run = decision.eager or decision.run
    modes, function_modes = torch._C._len_torch_dispatch_stack, \
        torch._C._is_torch_function_mode_enabled

    def direct(*args: Any, **kwargs: Any) -> torch.Tensor:
        if modes() or function_modes():        # a mode wants to see the op: let it
            return _dispatch(*args, **kwargs)
        return run(*args, **kwargs)
    if decision.prepare is None:
        return _remember(_entries, entry_key, direct)
    prepare, table, call = decision.prepare, _entries, SPEC.call_kernel

    def first(*args: Any, **kwargs: Any) -> torch.Tensor:
        """The key's first call: the entry, then what the kernel prepares for later ones."""
        if modes() or function_modes():
            return _dispatch(*args, **kwargs)
        out = run(*args, **kwargs)
        try:
            go = call(prepare, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the evaluator ran it; never fail a call on it
            log.warning("%s: the kernel's prepare() raised %s: %s; these calls take its entry",
                        NAMESPACE, type(e).__name__, e)
            go = None
        table[entry_key] = _prepared(go, call) if callable(go) else direct
        return out
    return _remember(_entries, entry_key, first)


def _prepared(go: Callable[..., torch.Tensor], call: Callable[..., torch.Tensor]
              ) -> Callable[..., torch.Tensor]:
    """attention()'s entry for a key whose kernel prepared `go` (see _entry_for)."""
    modes, function_modes = torch._C._len_torch_dispatch_stack, \
        torch._C._is_torch_function_mode_enabled

    def prepared(*args: Any, **kwargs: Any) -> torch.Tensor:
        if modes() or function_modes():
            return _dispatch(*args, **kwargs)
        _counts["kernel"] += 1
        return call(go, *args, **kwargs)
    return prepared


def _needs_grad(bound: problems.Args) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(v, torch.Tensor) and v.requires_grad for v in bound.values())


def _traced(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """attention() under torch.compile: the op (deciding at run time), or SDPA for grad."""
    if SPEC is None:
        raise NotImplementedError(f"problem {META['problem']} has no attention op")
    bound = SPEC.bind(args, dict(kwargs))
    if SPEC.fallback_for is not None and _needs_grad(bound):
        note_fallback("inputs require grad (the kernel is forward-only)")
        return SPEC.fallback_for(bound)(*bound.values())
    # trailing defaults left out, as an eager call's key has them: inductor (torch 2.13) laid
    # the op's output out as q's (B, S, H, D) views instead of as the fake says when a None
    # scale was passed, and the compiled graph failed its stride check
    return _dispatch(*SPEC.trim(tuple(bound.values())))
