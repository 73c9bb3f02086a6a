"""Loads the evolved kernel from kernel/ and returns its entry, built as the evaluator built it.

Three forms, as the evaluator ran them: a Python main file (its `.cu` companions, where their
`when(...)` conditions hold on this GPU, are built first and handed to it as the module
global EVOATTN_LIBRARIES = {"name.cu": "/path/lib.so"} before it runs); a fast-form `.cu`
exporting `extern "C" evoattn_sdpa` (called through ctypes on the current CUDA stream); a
PyTorch-extension `.cu` defining `attention`. The build, its cache key, flags and companion
rules are _runtime.py, the evaluator's own module shipped unchanged; builds run in child
processes. A library shipped as kernel/prebuilt/<stem>.<arch>.so is used as it is.
Cache: $EVOATTN_KERNEL_CACHE, else $XDG_CACHE_HOME/evoattn-kernels, else ~/.cache/evoattn-kernels.
Loading happens once per process and GPU target, on the first call the guard lets through; a
failure is remembered, not retried.
"""
from __future__ import annotations

import dataclasses
import math
import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from . import _runtime

KERNEL_DIR = Path(__file__).resolve().parent / "kernel"
BUILD_TIMEOUT_S = 900
_DTYPE_CODES = {getattr(torch, name): code for name, code in _runtime.DTYPE_CODES.items()}

_lock = threading.Lock()
_loaded: dict[str, Kernel | Exception] = {}


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or imported on this machine (the reason is the message)."""


@dataclasses.dataclass(frozen=True)
class Kernel:
    """The kernel's entry function, the input layouts it takes as they lie (its main
    module's INPUT_LAYOUTS: "strided" for any strides, "gqa" for k, v with fewer heads), and
    its main module's `prepare` (the entry's signature; after a call, it returns what runs
    later calls of the same shapes, strides, dtypes, device and other values, or None), which
    the evaluator checked and timed as the op calls it."""

    fn: Callable[..., Any]
    layouts: frozenset[str] = frozenset()
    prepare: Callable[..., Any] | None = None


def cache_root() -> Path:
    """Returns the directory holding built kernels."""
    if os.environ.get("EVOATTN_KERNEL_CACHE"):
        return Path(os.environ["EVOATTN_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "evoattn-kernels"


def kernel(meta: dict[str, Any], device: torch.device) -> Kernel:
    """Returns the kernel for a device (KernelUnavailable if it cannot be built or loaded)."""
    if device.type == "cuda":
        arch = _runtime.arch_for(*torch.cuda.get_device_capability(device))
    else:
        arch = device.type                 # Triton's CPU interpreter (tests): nothing to build
    with _lock:
        if arch not in _loaded:
            try:
                _loaded[arch] = _load(meta, arch)
            except Exception as e:  # noqa: BLE001 - any failure to load is remembered as data
                _loaded[arch] = e
        got = _loaded[arch]
    if isinstance(got, Exception):
        raise KernelUnavailable(f"{type(got).__name__}: {got}")
    return got


def _load(meta: dict[str, Any], arch: str) -> Kernel:
    main = KERNEL_DIR / meta["main"]
    if meta["form"] == "python":
        libraries = {}
        if arch.startswith("sm_"):
            facts = {"target": _runtime.target_fact(arch)}
            companions = [(c["name"], c["when"]) for c in meta["companions"]]
            libraries = {name: _build_fast(name, arch, meta)
                         for name in _runtime.cuda_companions(companions, meta["knobs"], facts)}
        module = import_main(meta, libraries)
        fn = getattr(module, meta["entry"], None)
        if not callable(fn):
            raise KernelUnavailable(f"{main.name} defines no function {meta['entry']}()")
        prepare = getattr(module, "prepare", None)
        return Kernel(fn, frozenset(getattr(module, "INPUT_LAYOUTS", ())),
                      prepare if callable(prepare) else None)
    if meta["form"] == "cuda-fast":
        return Kernel(_fast_entry(_runtime.load_fast(_build_fast(meta["main"], arch, meta),
                                                     "evoattn_sdpa")))
    res = _runtime.build_extension(main, cache_root(), arch, BUILD_TIMEOUT_S,
                                   nvcc=_runtime.find_nvcc())
    if not res.ok:
        raise KernelUnavailable(f"cannot build the extension {main.name} for {arch}:\n"
                                + _tail(res.log))
    ext = _runtime.load_extension(res.path)
    return Kernel(lambda q, k, v, causal=False, scale=None: ext.attention(
        q, k, v, bool(causal), float(scale if scale is not None else 1 / math.sqrt(q.shape[-1]))))


def _build_fast(name: str, arch: str, meta: dict[str, Any]) -> str:
    """Returns the library built from the fast-form kernel/<name> (shipped prebuilt, cached,
    or built now with the program's header companions beside it)."""
    source = KERNEL_DIR / name
    prebuilt = KERNEL_DIR / "prebuilt" / f"{source.stem}.{arch}.so"
    if prebuilt.is_file():
        return str(prebuilt)
    headers = _runtime.header_files(KERNEL_DIR, [c["name"] for c in meta["companions"]])
    res = _runtime.build_fast(source, cache_root(), arch, BUILD_TIMEOUT_S,
                              nvcc=_runtime.find_nvcc(), extra_files=headers)
    if not res.ok:
        raise KernelUnavailable(f"nvcc failed on {name} for {arch}:\n" + _tail(res.log))
    return str(res.path)


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def import_main(meta: dict[str, Any], libraries: dict[str, str] | None = None) -> Any:
    """Imports the Python main file by path (no sys.path change), its libraries given first."""
    import sys
    name = f"{meta['package']}._kernel_main"
    if name in sys.modules:
        return sys.modules[name]
    return _runtime.import_main(KERNEL_DIR / meta["main"], name, libraries)


def _fast_entry(cfn: Callable[..., int]) -> Callable[..., Any]:
    """Returns attention(q, k, v, causal, scale) over a fast-form library's evoattn_sdpa."""

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
