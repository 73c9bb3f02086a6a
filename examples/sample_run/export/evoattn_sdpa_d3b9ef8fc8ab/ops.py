"""The kernel as a PyTorch custom op: `torch.ops.<namespace>.attention`, with a fake for compile.

Dynamo and CUDA graphs see one opaque op whose output is a new contiguous tensor shaped like q
(an eager `attention()` call returns the kernel's output as the kernel lays it out: see
_route.kernel_run). What a call runs is decided once per call key (each tensor's shape, strides,
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
time. `stats()` (_stats) counts both kinds of call, and a call captured in a CUDA graph once per
replay (the op counts it on the device).

The rest lives in one module per job: _meta (kernel.json, the spec), _keys (call keys),
_route (what a key runs, counted), _stats (the counts), _native (the C++ path).

`use_kernel(False)` (or `with kernel_off():`) makes every call fall back, counted with the
reason "kernel switched off", so that a model can be timed with everything but the kernel
unchanged; each setting keeps its own decisions, so switching back and forth (a benchmark's
interleaved rounds) decides nothing twice. Compiled graphs follow it (the op
decides when it runs); a CUDA graph replays what it captured.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import torch

from . import _native, _route, _stats, problems
from ._route import KERNEL_OFF, Decision
from ._keys import GROWING as _GROWING
from ._keys import key as _key
from ._keys import named_key as _named_key
from ._meta import META, NAMESPACE, SPEC, log
from ._stats import note_fallback, reset_stats, stats

__all__ = ["META", "NAMESPACE", "SPEC", "KERNEL_OFF", "attention", "call_path", "kernel_enabled",
           "kernel_off", "log", "note_fallback", "op", "reset_stats", "stats", "use_kernel"]

MAX_DECISIONS = 4096                   # per table; a full table starts again empty

_kernel_enabled = True

# Per kernel setting (see use_kernel): the op's decisions and attention()'s entries, by call key.
_TABLES: dict[bool, tuple[dict, dict]] = {True: ({}, {}), False: ({}, {})}
_decisions: dict[tuple, Decision] = _TABLES[True][0]
_entries: dict[tuple, Callable[..., torch.Tensor]] = _TABLES[True][1]


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
    out = decision.run(*values)
    if decision.device is not None and _stats.capturing():
        _stats.count_captured(decision.reason, decision.device)   # counted per replay
    return out


def _decide(values: tuple[Any, ...], key: tuple) -> Decision:
    """Decides what a call key runs and remembers it (see _route.decide)."""
    decision, keep = _route.decide(values, _kernel_enabled)
    return _remember(_decisions, key, decision) if keep else decision


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
        _stats.log_once(reason)
        return _remember(_entries, entry_key,
                         _route.counted(reason, SPEC.fallback_for(bound), False, args, bound))
    values = SPEC.trim(tuple(bound.values()))   # as the op will get them: the same key
    key = _key(values)
    decision = _decisions.get(key) or _decide(values, key)
    if key not in _decisions:                   # decided for this call only (see _decide)
        return _dispatch
    if decision.fallback is not None:
        return _remember(_entries, entry_key, _route.counted(
            str(decision.reason), decision.fallback, False, args, bound))
    tensors_positional = all(not isinstance(v, torch.Tensor) for v in kwargs.values())
    # A refusal to raise, tensors passed by name, tensor subclasses: the op handles them.
    if decision.reason is not None or not tensors_positional or \
            any(type(v) is not torch.Tensor for v in values if isinstance(v, torch.Tensor)):
        return _remember(_entries, entry_key, _dispatch)
    return _remember(_entries, entry_key, _kernel_entry(decision, entry_key))


def _kernel_entry(decision: Decision, entry_key: tuple) -> Callable[..., torch.Tensor]:
    """attention()'s entry for a key the kernel runs: the op's run without the dispatcher,
    except where a mode wants to see the op or a CUDA graph captures the call (the op counts
    it per replay); from the key's second call, what the kernel prepared, where it does."""
    run, graphed = decision.eager or decision.run, decision.device is not None
    modes, function_modes = torch._C._len_torch_dispatch_stack, \
        torch._C._is_torch_function_mode_enabled

    def direct(*args: Any, **kwargs: Any) -> torch.Tensor:
        if modes() or function_modes() or (graphed and _stats.capturing()):
            return _dispatch(*args, **kwargs)
        return run(*args, **kwargs)
    if decision.prepare is None:
        return direct
    prepare, table, call = decision.prepare, _entries, SPEC.call_kernel

    def first(*args: Any, **kwargs: Any) -> torch.Tensor:
        """The key's first call: the entry, then what the kernel prepares for later ones."""
        if modes() or function_modes() or (graphed and _stats.capturing()):
            return _dispatch(*args, **kwargs)
        out = run(*args, **kwargs)
        try:
            go = call(prepare, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the evaluator ran it; never fail a call on it
            log.warning("%s: the kernel's prepare() raised %s: %s; these calls take its entry",
                        NAMESPACE, type(e).__name__, e)
            go = None
        table[entry_key] = _prepared(go, call, graphed) if callable(go) else direct
        return out
    return first


def _prepared(go: Callable[..., torch.Tensor], call: Callable[..., torch.Tensor],
              graphed: bool) -> Callable[..., torch.Tensor]:
    """attention()'s entry for a key whose kernel prepared `go` (see _kernel_entry)."""
    modes, function_modes = torch._C._len_torch_dispatch_stack, \
        torch._C._is_torch_function_mode_enabled
    counts = _stats.counts

    def prepared(*args: Any, **kwargs: Any) -> torch.Tensor:
        if modes() or function_modes() or (graphed and _stats.capturing()):
            return _dispatch(*args, **kwargs)
        counts["kernel"] += 1
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
