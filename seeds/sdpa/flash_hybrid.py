"""Seed for `sdpa`: the Triton kernel and, on an H100/H200, the wgmma CUDA kernel, behind one
`attention`, chosen per call by the CUDA_* knobs.

  flash_triton.py   the FlashAttention-2/3-style Triton kernel (its own knobs): every call on
                    other GPUs, in float32, in Triton's CPU interpreter, on views or GQA
                    inputs the CUDA kernel does not take (no copies), and those CUDA_* keep
  wgmma_flash.cu    the FlashAttention-3-style wgmma kernel for sm_90a (its own knobs), built
                    with nvcc by whoever loads this file (the evaluator, an exported package)
                    and handed over in EVOATTN_LIBRARIES; without it every call runs Triton.
                    Its warp-specialised path also reads views and GQA inputs in place.
The defaults send head dim 128 to CUDA, and 64 too where the call gives every SM a work item
(CUDA_D64_FILL_KEYS); smaller head-dim-64 calls stay on Triton, whose smaller tiles and grid
measured faster there. A
knob whose code no call runs at these routing values and this GPU (its when(...) conditions)
is left alone by the mutator.
"""
# evoattn: companion flash_triton.py
# evoattn: companion wgmma_flash.cu when(@target=sm90) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D128=True, CUDA_D128_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
# evoattn: companion cuda_core_flash.cuh when(@target=sm90) when(CUDA_D64=True, CUDA_D64_CAUSAL=True, CUDA_D128=True, CUDA_D128_CAUSAL=True, CUDA_D64_SMALL!=0, CUDA_D64_FILL_KEYS!=0)
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
# ... and D=64 calls of at most this work (B*H*Sq*Sk): a cheaper host launch
CUDA_D64_SMALL = 0  # evoattn: choice(0, 4194304, 16777216, 67108864) when(@target=sm90)
# ... and D=64 calls of at most this many keys that give every SM a 128-row work item
# (B*H*ceil(Sq/128) >= SMs), causal or not (0: none)
CUDA_D64_FILL_KEYS = 65536  # evoattn: choice(0, 512, 2048, 65536) when(@target=sm90)

_CUDA_DTYPES = {torch.float16: 0, torch.bfloat16: 1}
# The codes the CUDA entry returns itself, named in errors (others are raised by number).
_CUDA_ERRORS = {1: "cudaErrorInvalidValue: a shape, or too much shared memory (WS_STAGES_D128 "
                   "too deep: only 2 fit beside TMA_STORE_MAX_S's tile)",
                9: "cudaErrorInvalidConfiguration: too many work items for one grid",
                98: "cudaErrorInvalidDeviceFunction: built without sm_90a code",
                801: "cudaErrorNotSupported: the driver has no cuTensorMapEncodeTiled"}
_LIBRARIES: dict = globals().get("EVOATTN_LIBRARIES", {})   # set by the loader, see above
INPUT_LAYOUTS = ("strided", "gqa")  # read where they lie, by CUDA where _viewable, else Triton
_NOT_TAKEN = 1000    # the strided CUDA entry launched nothing


def _sibling(name: str):  # noqa: ANN202
    """Imports a companion .py file beside this one."""
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
    """The CUDA entry point, or None (warned once) when no library was handed over."""
    path = _LIBRARIES.get("wgmma_flash.cu")
    if path is None:
        warnings.warn("flash_hybrid: wgmma_flash.cu is not built (evoattn builds it when it "
                      "evaluates or exports this program): CUDA_* calls run Triton",
                      RuntimeWarning, stacklevel=4)
        return None
    fn = ctypes.CDLL(path).evoattn_sdpa
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p]
    return fn


@functools.lru_cache(maxsize=None)
def _strided_entry(device: torch.device, head_dim: int):  # noqa: ANN202
    """The CUDA entry for views and grouped k/v if ready for this head dim and device, or None."""
    lib = ctypes.CDLL(_LIBRARIES["wgmma_flash.cu"])
    fn, ready = (getattr(lib, f"evoattn_sdpa_strided{x}", None) for x in ("", "_ready"))
    with torch.cuda.device(device):
        if fn is None or ready is None or not ready(head_dim):
            return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 7 + [ctypes.c_float] + [ctypes.c_void_p] * 2
    return fn


def _cuda_wanted(device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool,
                 small: bool = False, fills: bool = False) -> bool:
    """Returns True when such a call goes to the CUDA kernel (its knob is set and it can run)."""
    if device.type != "cuda" or _triton._interpreting() or dtype not in _CUDA_DTYPES:
        return False
    if head_dim == 64:
        wanted = small or fills or (CUDA_D64_CAUSAL if causal else CUDA_D64)
    elif head_dim == 128:
        wanted = CUDA_D128_CAUSAL if causal else CUDA_D128
    else:
        return False
    return wanted and _is_sm90(device) and _cuda_entry() is not None


_ROUTES: dict[tuple, bool] = {}   # (device, dtype, D, causal, small, fills) -> CUDA?


def _route(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    (B, H, Sq), Sk = q.shape[:3], k.shape[2]
    small = B * H * Sq * Sk <= CUDA_D64_SMALL
    fills = Sk <= CUDA_D64_FILL_KEYS and B * H * -(-Sq // 128) >= _triton._num_sms(q.device)
    key = (q.device, q.dtype, q.shape[-1], causal, small, fills)
    route = _ROUTES.get(key)
    if route is None:
        route = _ROUTES[key] = _cuda_wanted(*key)
    return route


def _cuda_call(q: torch.Tensor, is_causal: bool, sm_scale: float, k: torch.Tensor | None = None,
               v: torch.Tensor | None = None):  # noqa: ANN202
    """The CUDA kernel's call for inputs like q (_dense) or, given k and v, like q, k, v
    (_viewable), on the current stream; a strided call it does not take runs Triton."""
    index, code = q.device.index, _CUDA_DTYPES[q.dtype]
    strides = None                                    # kept alive by call()
    if k is None:
        entry, fixed = _cuda_entry(), (*q.shape, code, int(is_causal), sm_scale)
    else:
        entry, (B, H, S, D) = _strided_entry(q.device, q.shape[-1]), q.shape
        strides = (ctypes.c_longlong * 12)(*(x for st in (q.stride(), k.stride(), v.stride(),
                                                          _out_strides(q.shape, q.stride()))
                                               for x in st[:3]))
        fixed = (B, H, k.shape[1], S, D, code, int(is_causal), sm_scale, ctypes.addressof(strides))
    current, stream = torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
             scale: float | None = None, _keep=strides) -> torch.Tensor:  # noqa: ANN001
        out = torch.empty_like(q)
        args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), *fixed)
        if index == current():
            rc = entry(*args, stream(index))
        else:
            with torch.cuda.device(index):
                rc = entry(*args, stream(index))
        if rc == _NOT_TAKEN:
            return _triton.attention(q, k, v, is_causal, sm_scale)
        if rc != 0:
            raise RuntimeError(f"flash_hybrid: CUDA error {rc} ({_CUDA_ERRORS.get(rc, 'cudaGetErrorString')}) "
                               f"for {tuple(q.shape)} {q.dtype} causal={is_causal}")
        return out
    return call


@functools.lru_cache(maxsize=256)
def _out_strides(shape: tuple, stride: tuple) -> tuple:
    """The strides of torch.empty_like(q) (the output call() makes) for q of this layout, found
    on the meta device: no allocation per unprepared call."""
    return torch.empty_like(torch.empty_strided(shape, stride, device="meta")).stride()


def _cuda_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              scale: float):  # noqa: ANN202
    """The CUDA kernel's call for inputs like these, or None where they run Triton."""
    if not _route(q, k, causal):
        return None
    if _dense(q, k, v):
        return _cuda_call(q, causal, scale)
    return _cuda_call(q, causal, scale, k, v) if _viewable(q, k, v) else None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Returns softmax(q kᵀ·scale [+ top-left causal mask]) v for (B, H, S, D) inputs, from
    the CUDA kernel where the CUDA_* knobs send the call (and it takes the layout), else Triton."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    call = _cuda_for(q, k, v, bool(causal), float(scale))
    if call is not None:
        return call(q, k, v)
    return _triton.attention(q, k, v, causal, scale)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
            scale: float | None = None):  # noqa: ANN201
    """attention() for later calls with this one's shapes, strides, dtypes, device, causal and
    scale, without its routing (None where Triton prepared nothing)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    call = _cuda_for(q, k, v, bool(causal), float(scale))
    if call is not None:
        return call
    return _triton.prepare(q, k, v, causal, scale)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the CUDA kernel takes these inputs: contiguous, of one shape, dtype and device."""
    return (q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype
            and q.device == k.device == v.device
            and q.is_contiguous() and k.is_contiguous() and v.is_contiguous())


def _viewable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the strided CUDA entry takes these where they lie: q (B, H, S, D), k and v (B, Hkv,
    S, D), Hkv dividing H, one dtype and device, last dims dense, other strides nonzero multiples
    of 16 bytes, pointers 16-byte aligned (TMA's rules), on a build and GPU that take them."""
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device
            and q.dim() == 4 and k.shape == v.shape and k.dim() == 4):
        return False
    B, H, S, D = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D or H % k.shape[1]:
        return False
    for t in (q, k, v):
        st = t.stride()
        if st[3] != 1 or t.data_ptr() % 16 or any(x < 8 or x % 8 for x in st[:3]):
            return False
    return _strided_entry(q.device, D) is not None
