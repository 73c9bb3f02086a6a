"""The harness snapshot: which harness names a candidate replaced (class 8, tampering).

Taken before the candidate is imported and checked before and after every call.
"""
from __future__ import annotations

from typing import Any, Callable


def harness_snapshot(modules: list[Any]) -> Callable[[], list[str]]:
    """Returns a check listing the harness names that no longer hold the object they hold now.

    Covers every global of `modules` (functions, classes, the modules the harness calls
    through, constants), every attribute of the classes they define (a problem's
    `baseline`, `Violations.add`), each function's `__code__`, and the torch functions
    the checks and timers use. Only identity counts (`is`): a stand-in object cannot
    pass by overriding `__eq__`. The check is a closure that binds `getattr` itself and
    never looks up a module global, so replacing this module's functions (or
    `guards.tampered`) does not blind it; the caller must keep the returned function.
    """
    import time

    import torch
    import torch.nn.functional as F

    torch_attrs = [
        ("time", time, ("perf_counter", "perf_counter_ns")),
        ("torch", torch, ("matmul", "softmax", "isfinite", "max", "abs", "randn", "equal")),
        ("torch.Tensor", torch.Tensor, ("masked_fill", "float", "copy_", "clone", "sub",
                                        "__sub__", "data_ptr", "normal_")),
        ("F", F, ("softmax", "scaled_dot_product_attention")),
        ("torch.cuda", torch.cuda, ("synchronize", "Event", "max_memory_allocated",
                                    "memory_allocated", "reset_peak_memory_stats",
                                    "current_stream")),
        ("torch.cuda.Event", torch.cuda.Event, ("elapsed_time", "record", "synchronize")),
    ]
    if torch.cuda.is_initialized():                   # the timer's spin: a CUDA graph replay
        torch_attrs += [("torch.cuda.CUDAGraph", torch.cuda.CUDAGraph, ("replay",)),
                        ("torch._C._CUDAGraph", torch._C._CUDAGraph, ("replay",))]
    attrs = [(f"{label}.{name}", owner, name, getattr(owner, name))
             for label, owner, names in torch_attrs for name in names]
    spaces: list[tuple[str, Any]] = []                  # (prefix, module or class)
    for mod in modules:
        spaces.append((mod.__name__, mod))
        spaces += [(f"{mod.__name__}.{name}", obj) for name, obj in vars(mod).items()
                   if isinstance(obj, type) and obj.__module__ == mod.__name__]
    slots: list[tuple[str, Any, str, Any]] = []         # (name, its namespace mapping, key, object)
    codes: list[tuple[str, Any, Any]] = []
    for prefix, space in spaces:
        for name, obj in vars(space).items():
            has_code = hasattr(obj, "__code__")
            if name.startswith("__") and not has_code:
                continue                                # __doc__, __dict__, __module__ ...
            slots.append((f"{prefix}.{name}", vars(space), name, obj))
            if has_code:                                # swapping __code__ keeps the identity
                codes.append((f"{prefix}.{name}.__code__", obj, obj.__code__))
    getattr_, missing = getattr, object()

    def tampered() -> list[str]:
        changed = []
        for name, owner, key, obj in attrs:
            if getattr_(owner, key, missing) is not obj:
                changed.append(name)
        for name, space, key, obj in slots:
            if space.get(key, missing) is not obj:
                changed.append(name)
        for name, fn, code in codes:
            if fn.__code__ is not code:
                changed.append(name)
        return changed

    return tampered
