"""Loads the evolved kernel from kernel/ by path and returns its entry function.

Three forms, as the evaluator ran them: a Python main file (its `.cu` companions, where their
`when(...)` conditions hold on this GPU, are built first and handed to it as the module
global EVOATTN_LIBRARIES = {"name.cu": "/path/lib.so"} before it runs); a fast-form `.cu`
exporting `extern "C" evoattn_sdpa` (called through ctypes on the current CUDA stream); a
PyTorch-extension `.cu` defining `attention`. Loading happens once per process and GPU
target, on the first call the guard lets through; a failure is remembered, not retried.
"""
from __future__ import annotations

import ctypes
import importlib.util
import math
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from . import _build

KERNEL_DIR = Path(__file__).resolve().parent / "kernel"
LIBRARIES_GLOBAL = "EVOATTN_LIBRARIES"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}

_lock = threading.Lock()
_loaded: dict[str, Callable[..., Any] | Exception] = {}


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or imported on this machine (the reason is the message)."""


_by_device: dict[torch.device, Callable[..., Any]] = {}   # the per-call fast path


def kernel(meta: dict[str, Any], device: torch.device) -> Callable[..., Any]:
    """Returns the kernel's entry function for a CUDA device (KernelUnavailable if it cannot load)."""
    fn = _by_device.get(device)
    if fn is not None:
        return fn
    target = _build.arch_of(torch.cuda.get_device_capability(device))
    with _lock:
        if target not in _loaded:
            try:
                _loaded[target] = _load(meta, target)
            except Exception as e:  # noqa: BLE001 - any failure to load is remembered as data
                _loaded[target] = e
        got = _loaded[target]
    if isinstance(got, Exception):
        raise KernelUnavailable(f"{type(got).__name__}: {got}")
    _by_device[device] = got
    return got


def _load(meta: dict[str, Any], target: str) -> Callable[..., Any]:
    main = KERNEL_DIR / meta["main"]
    if meta["form"] == "python":
        libraries = {c["name"]: _build.build_fast(KERNEL_DIR / c["name"], target)
                     for c in meta["companions"]
                     if c["name"].endswith(".cu") and _holds(c["when"], meta["knobs"], target)}
        module = import_main(meta, libraries)
        fn = getattr(module, meta["entry"], None)
        if not callable(fn):
            raise KernelUnavailable(f"{main.name} defines no function {meta['entry']}()")
        return fn
    if meta["form"] == "cuda-fast":
        return _fast_entry(_build.build_fast(main, target))
    ext = _build.build_extension(main, target)
    return lambda q, k, v, causal=False, scale=None: ext.attention(
        q, k, v, bool(causal), float(scale if scale is not None else 1 / math.sqrt(q.shape[-1])))


def import_main(meta: dict[str, Any], libraries: dict[str, str] | None = None) -> Any:
    """Imports the Python main file by path (no sys.path change), its libraries given first."""
    name = f"{meta['package']}._kernel_main"
    if name in sys.modules:
        return sys.modules[name]
    path = KERNEL_DIR / meta["main"]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise KernelUnavailable(f"{path} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    setattr(module, LIBRARIES_GLOBAL, dict(libraries or {}))
    sys.modules[name] = module         # Triton and dataclasses look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _holds(when: list[list[list[str]]], knobs: dict[str, str], target: str) -> bool:
    """Returns whether a companion's when(...) groups hold: all groups, any term of each."""
    facts = {"target": "sm" + target[3:].rstrip("a")}

    def term(name: str, op: str, value: str) -> bool:
        have = facts.get(name[1:]) if name.startswith("@") else knobs.get(name)
        return True if have is None else (have == value) == (op == "=")

    return all(any(term(*t) for t in group) for group in when)


def _fast_entry(library: str) -> Callable[..., Any]:
    """Returns attention(q, k, v, causal, scale) over the library's evoattn_sdpa."""
    cfn = ctypes.CDLL(library).evoattn_sdpa
    cfn.restype = ctypes.c_int
    cfn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  scale: float | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        B, H, S, D = q.shape
        scale = scale if scale is not None else 1.0 / math.sqrt(D)
        # A real torch.cuda.Stream here: this runs inside the custom op, never under Dynamo.
        stream = torch.cuda.current_stream(q.device).cuda_stream
        with torch.cuda.device(q.device):
            code = cfn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), B, H, S, D,
                       _DTYPE_CODES[q.dtype], int(bool(causal)), scale, stream)
        if code != 0:
            raise RuntimeError(f"evoattn_sdpa returned CUDA error {code}")
        return out

    return attention
