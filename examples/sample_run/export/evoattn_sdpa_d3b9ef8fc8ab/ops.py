"""The kernel as a PyTorch custom op: `torch.ops.<namespace>.attention`, with a fake for compile.

Dynamo and CUDA graphs see one opaque op whose output is a new contiguous tensor shaped like
q; inside it the guard decides per call: the evolved kernel on what it was verified on (inputs
made contiguous first), PyTorch SDPA elsewhere (logged once per reason at debug level on this
package's logger). `stats()` counts both; a CUDA graph replay runs no Python, so replays are
not counted.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from . import _loader, guard, problems

META: dict[str, Any] = json.loads((Path(__file__).resolve().parent / "kernel.json").read_text())
NAMESPACE: str = META["namespace"]
SPEC = problems.spec_for(META)
log = logging.getLogger(META["package"])

_counts = {"kernel": 0, "fallback": 0}
_reasons: dict[str, int] = {}
_logged: set[str] = set()


def stats() -> dict[str, Any]:
    """Returns how many calls ran the kernel and how many fell back, with the reasons.

    Under torch.compile the op's own calls are counted as they run; a call that Python code
    around the op sends elsewhere (the Hugging Face integration's refusals, inputs that need
    grad) is decided once when the graph is traced and is not counted per call: counting it
    would make the count a constant of the graph, and every call a recompile."""
    return {"kernel": _counts["kernel"], "fallback": _counts["fallback"],
            "fallback_reasons": dict(_reasons)}


def reset_stats() -> None:
    """Sets the call counts back to zero."""
    _counts["kernel"] = _counts["fallback"] = 0
    _reasons.clear()


def note_kernel() -> None:
    """Counts one call that ran the evolved kernel."""
    _counts["kernel"] += 1


def note_fallback(reason: str) -> None:
    """Counts one call that ran PyTorch instead; logs the reason the first time it is seen."""
    if torch.compiler.is_compiling():
        return
    _counts["fallback"] += 1
    _reasons[reason] = _reasons.get(reason, 0) + 1
    if reason not in _logged:
        _logged.add(reason)
        log.debug("%s: falling back to PyTorch SDPA: %s", NAMESPACE, reason)


def _run(*values: Any, **named: Any) -> torch.Tensor:
    """Runs one call: the kernel where the guard allows it, else the fallback."""
    assert SPEC is not None
    args = SPEC.bind(values, named)
    reason = guard.refusal(META["verified"], SPEC, args)
    fn = None
    if reason is None:
        try:
            first = next(args[p.name] for p in SPEC.params if p.is_tensor)
            fn = _loader.kernel(META, first.device)
        except _loader.KernelUnavailable as e:
            reason = f"kernel unavailable: {e}"
            if reason not in _logged:
                _logged.add(reason)
                log.warning("%s: %s; running PyTorch SDPA instead", NAMESPACE, reason)
    if fn is None:
        if SPEC.fallback is None:
            raise NotImplementedError(f"{NAMESPACE}.attention: {reason}, and this problem has "
                                      "no PyTorch fallback")
        note_fallback(str(reason))
        return SPEC.fallback(args).contiguous()
    note_kernel()
    dense = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    return SPEC.call_kernel(fn, dense).contiguous()


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


def attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Runs the op; inputs that need gradients take differentiable PyTorch SDPA instead."""
    if SPEC is None:
        raise NotImplementedError(f"problem {META['problem']} has no attention op; "
                                  "see load_kernel_module()")
    bound = SPEC.bind(args, dict(kwargs))
    if torch.is_grad_enabled() and SPEC.fallback is not None and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in bound.values()):
        note_fallback("inputs require grad (the kernel is forward-only)")
        return SPEC.fallback(bound)
    return _dispatch(*bound.values())             # bind() keeps the schema's order
