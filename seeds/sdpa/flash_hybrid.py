"""Seed for `sdpa`: the Triton kernel and, on an H100/H200, the wgmma CUDA kernel, behind one
`attention`, chosen per head dim and causality by the CUDA_* knobs.

  flash_triton.py   the FlashAttention-2/3-style Triton kernel, with its own knobs: every call
                    on other GPUs, in float32 and in Triton's CPU interpreter, and the calls the
                    CUDA_* knobs keep off CUDA
  wgmma_flash.cu    the FlashAttention-3-style wgmma kernel for sm_90a, with its own knobs;
                    whoever loads this file (the evaluator, an exported package) builds it with
                    nvcc and hands the library over in EVOATTN_LIBRARIES. Without it (no nvcc, a
                    GPU other than sm_90, or this file imported by hand) every call runs Triton.
The defaults send head dim 128 to CUDA and keep 64 on Triton, which measured faster there
(BENCHMARKS.md); CUDA_D64_SMALL can send the launch-bound head-dim-64 calls to CUDA as well. Both companions' knobs are the program's knobs: a knob whose code no call runs
at these routing values and this GPU (its when(...) conditions) is left alone by the mutator.
"""
# evoattn: companion flash_triton.py
# evoattn: companion wgmma_flash.cu when(@target=sm90) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D128=True, CUDA_D128_CAUSAL=True, CUDA_D64_SMALL!=0)
# evoattn: companion cuda_core_flash.cuh when(@target=sm90) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D128=True, CUDA_D128_CAUSAL=True, CUDA_D64_SMALL!=0)
from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
import os
import warnings

import torch

# Which calls take the CUDA kernel (compute capability 9.0, float16/bfloat16; all others Triton).
CUDA_D64 = False  # evoattn: choice(True, False) when(@target=sm90)
CUDA_D64_CAUSAL = False  # evoattn: choice(True, False) when(@target=sm90)
CUDA_D128 = True  # evoattn: choice(True, False) when(@target=sm90)
CUDA_D128_CAUSAL = True  # evoattn: choice(True, False) when(@target=sm90)
# ... and head-dim-64 calls of at most this much work (B·H·Sq·Sk) take CUDA whatever CUDA_D64*
# say: launch-bound shapes, where the ctypes call costs 15-40 µs less host time than Triton's
# launcher (BENCHMARKS.md). 0: none.
CUDA_D64_SMALL = 0  # evoattn: choice(0, 4194304, 16777216, 67108864) when(@target=sm90)

_CUDA_DTYPES = {torch.float16: 0, torch.bfloat16: 1}
# The codes the CUDA entry returns itself, named in errors (others are raised by number).
_CUDA_ERRORS = {1: "cudaErrorInvalidValue: a shape, or more shared memory than a block can "
                   "have (WS_STAGES too deep for the tile; at D=128 only 2 stages fit beside "
                   "TMA_STORE_MAX_S's output tile)",
                9: "cudaErrorInvalidConfiguration: too many work items for one grid",
                98: "cudaErrorInvalidDeviceFunction: built without sm_90a code",
                801: "cudaErrorNotSupported: the driver has no cuTensorMapEncodeTiled"}
_LIBRARIES: dict = globals().get("EVOATTN_LIBRARIES", {})   # set by the loader, see above
INPUT_LAYOUTS = ("strided", "gqa")  # see flash_triton.py (CUDA calls copy)


def _sibling(name: str):  # noqa: ANN202
    """Loads a companion .py file beside this one as a module of its own."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    spec = importlib.util.spec_from_file_location(f"{__name__}_{name[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_triton = _sibling("flash_triton.py")


@functools.lru_cache(maxsize=None)
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


@functools.lru_cache(maxsize=None)
def _cuda_entry():  # noqa: ANN202
    """The CUDA kernel's entry point, or None (with one warning) when no library was handed over."""
    path = _LIBRARIES.get("wgmma_flash.cu")
    if path is None:
        warnings.warn("flash_hybrid: no built wgmma_flash.cu library (evaluate or export this "
                      "program with evoattn to build it with nvcc), so the calls the CUDA_* "
                      "knobs send to CUDA run the Triton kernel", RuntimeWarning, stacklevel=4)
        return None
    fn = ctypes.CDLL(path).evoattn_sdpa
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p]
    return fn


def _cuda_wanted(device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool,
                 small: bool = False) -> bool:
    """Returns True when such a call goes to the CUDA kernel (its knob is set and it can run);
    `small`: the call's work is within CUDA_D64_SMALL."""
    if device.type != "cuda" or _triton._interpreting() or dtype not in _CUDA_DTYPES:
        return False
    if head_dim == 64:
        wanted = small or (CUDA_D64_CAUSAL if causal else CUDA_D64)
    elif head_dim == 128:
        wanted = CUDA_D128_CAUSAL if causal else CUDA_D128
    else:
        return False
    return wanted and _is_sm90(device) and _cuda_entry() is not None


_ROUTES: dict[tuple, bool] = {}   # (device, dtype, head dim, causal, small) -> CUDA?, decided once


def _cuda_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> torch.Tensor:
    """Runs the CUDA kernel on the current stream of q's device."""
    if not (q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype
            and q.device == k.device == v.device):
        _triton._check_inputs(q, k, v)             # raises unless GQA, which CUDA does not take
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()   # it takes no strides either
    out = torch.empty_like(q)
    B, H, S, D = q.shape
    index = q.device.index
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), B, H, S, D,
            _CUDA_DTYPES[q.dtype], int(causal), scale)
    if index == torch.cuda.current_device():
        rc = _cuda_entry()(*args, torch._C._cuda_getCurrentRawStream(index))
    else:
        with torch.cuda.device(index):
            rc = _cuda_entry()(*args, torch._C._cuda_getCurrentRawStream(index))
    if rc != 0:
        raise RuntimeError(f"flash_hybrid: the CUDA kernel returned CUDA error {rc} "
                           f"({_CUDA_ERRORS.get(rc, 'see cudaGetErrorString')}) for "
                           f"{tuple(q.shape)} {q.dtype} causal={causal}")
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Returns softmax(q kᵀ·scale [+ top-left causal mask]) v for (B, H, S, D) inputs, from
    the CUDA kernel where the CUDA_* knobs send the call, else from the Triton kernel."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    causal = bool(causal)
    small = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= CUDA_D64_SMALL
    key = (q.device, q.dtype, q.shape[-1], causal, small)
    route = _ROUTES.get(key)
    if route is None:
        route = _ROUTES[key] = _cuda_wanted(q.device, q.dtype, q.shape[-1], causal, small)
    if route:
        return _cuda_attention(q, k, v, causal, float(scale))
    return _triton.attention(q, k, v, causal, scale)
