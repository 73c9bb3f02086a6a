"""What one call key runs: the guard's checks, the kernel's load and a layout check, made into
a Decision whose callables count each call they run (see _stats)."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from . import _loader, _stats, guard, problems
from ._meta import META, NAMESPACE, SPEC

KERNEL_OFF = "kernel switched off"


class Decision(NamedTuple):
    """What the op runs for one call key."""

    run: Callable[..., torch.Tensor]                 # takes the op's values in schema order
    fallback: Callable[..., torch.Tensor] | None     # SDPA, when the call falls back
    reason: str | None                               # why it falls back
    eager: Callable[..., torch.Tensor] | None = None  # attention()'s run (see kernel_run)
    prepare: Callable[..., Any] | None = None        # the kernel's, where it takes the inputs
    device: torch.device | None = None               # where a graph may capture its calls


def decide(values: tuple[Any, ...], enabled: bool) -> tuple[Decision, bool]:
    """Returns what a call runs, and whether its key may keep that decision (not while a CUDA
    graph is captured before the kernel's layout check could run)."""
    assert SPEC is not None
    args = SPEC.bind(values, {})              # the dispatcher leaves trailing defaults out
    first = next(args[p.name] for p in SPEC.params if p.is_tensor)
    device = first.device if _stats.graphed(first.device) else None
    if device is not None:
        _stats.watch(device)
    reason = guard.refusal(META["verified"], SPEC, args) if enabled else KERNEL_OFF
    kernel = None
    if reason is None:
        try:
            kernel = _loader.kernel(META, first.device)
        except _loader.KernelUnavailable as e:
            reason = f"kernel unavailable: {e}"
            _stats.log_once(reason, warning=True)
    if kernel is None:
        _stats.log_once(str(reason))
        if SPEC.fallback_for is None:
            return Decision(refuse(str(reason)), None, reason, device=device), True
        fallback = SPEC.fallback_for(args)
        return Decision(counted(str(reason), fallback, True), fallback, reason,
                        device=device), True
    direct = takes_as_given(kernel, args, values)
    run, eager = kernel_run(kernel.fn, direct is True)
    # a growing key covers many shapes, more than prepare() is asked to hold for
    prepare = kernel.prepare if direct is True and not SPEC.growing else None
    return Decision(run, None, None, eager, prepare, device), direct is not None


def takes_as_given(kernel: _loader.Kernel, args: problems.Args,
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


def kernel_run(fn: Callable[..., Any], direct: bool
               ) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """Returns what runs the kernel: on the inputs as they are, or on dense copies (tensors
    come positionally; other arguments may come by name, as a Python call passes them), for
    the op (its output contiguous, as the fake says) and for attention()'s eager calls (the
    kernel's output as it comes: the default seed lays it out as q, as SDPA does, so that
    transformers transposes its (B, S, H, D) views back without a copy)."""
    call, dense, counts = SPEC.call_kernel, SPEC.dense, _stats.counts

    if direct:
        def run(*values: Any, **named: Any) -> torch.Tensor:
            counts["kernel"] += 1
            return call(fn, *values, **named).contiguous()

        def eager(*values: Any, **named: Any) -> torch.Tensor:
            counts["kernel"] += 1
            return call(fn, *values, **named)
    else:
        def run(*values: Any, **named: Any) -> torch.Tensor:
            counts["kernel"] += 1
            return call(fn, *dense(values), **named).contiguous()

        def eager(*values: Any, **named: Any) -> torch.Tensor:
            counts["kernel"] += 1
            return call(fn, *dense(values), **named)
    return run, eager


def counted(reason: str, fallback: Callable[..., torch.Tensor], contiguous: bool,
            args: tuple[Any, ...] = (), bound: problems.Args | None = None
            ) -> Callable[..., torch.Tensor]:
    """Returns the fallback, counting each call (the op's output is contiguous, like its fake).
    Given the call's positional args and bound arguments, where the problem calls its fallback
    directly (OpSpec.direct) and the call passes q, k, v first: a Direct."""
    cell = _stats.reason_cell(reason)
    if not contiguous:
        direct = SPEC.direct(fallback, bound) if SPEC is not None and bound else None
        if direct is not None:
            fn, values, names = direct
            n = SPEC.leading_tensors
            if len(args) >= n and all(isinstance(x, torch.Tensor) for x in args[:n]):
                return Direct((cell, fn, n, values, names))

        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            cell[0] += 1
            return fallback(*args, **kwargs)
        return run

    def run_contiguous(*args: Any, **kwargs: Any) -> torch.Tensor:
        cell[0] += 1
        return fallback(*args, **kwargs).contiguous()
    return run_contiguous


class Direct(tuple):
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


def refuse(reason: str) -> Callable[..., torch.Tensor]:
    """Returns a run that raises: the problem has no fallback."""
    def run(*values: Any) -> torch.Tensor:
        raise NotImplementedError(f"{NAMESPACE}.attention: {reason}, and this problem has "
                                  "no PyTorch fallback")
    return run
