"""Decides whether a call is one the kernel was verified on; says why not otherwise.

The verified set comes from the run's evaluation of this kernel (kernel.json "verified"):
the device type and GPU compute capability it ran on, the dtypes, head dims and causal
values of its checked configs. Shapes follow the problem's contract (its evaluation also
checked odd sequence lengths); tensors past 2**31 elements are refused because no
evaluation reaches them and 32-bit offsets are common in kernels. A layout the contract does
not have (strides, k/v with fewer heads under `sdpa`) is not refused: _route.py passes it to
a kernel that takes it, and gives other kernels contiguous copies. ops.py asks once per call
key and keeps the answer.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from .problems import Args, OpSpec

INT32_ELEMENTS = 2 ** 31
# Device types the kernel is served on. A kernel verified on the CPU ran in Triton's
# interpreter: far too slow to serve, so such a package always falls back (tests add "cpu").
KERNEL_DEVICE_TYPES = ("cuda",)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"{major}.{minor}"


def refusal(verified: dict[str, Any], spec: OpSpec, args: Args) -> str | None:
    """Returns why the kernel must not run on these arguments, or None when it may."""
    tensors = [args[p.name] for p in spec.params if p.is_tensor and args[p.name] is not None]
    first = tensors[0]
    if verified["device_type"] not in KERNEL_DEVICE_TYPES:
        return f"verified on {verified['device_type']} only (the kernel runs on CUDA GPUs)"
    if first.device.type != verified["device_type"]:
        return f"{first.device.type} tensors (the kernel runs on CUDA GPUs)"
    if any(t.device != first.device for t in tensors):
        return "tensors on different devices"
    if first.device.type == "cuda":
        cap = _capability(first.device.index if first.device.index is not None
                          else torch.cuda.current_device())
        if cap not in verified["capabilities"]:
            return (f"GPU compute capability {cap}; verified on "
                    f"{', '.join(verified['capabilities']) or 'none recorded'}")
    dtype = str(first.dtype).replace("torch.", "")
    # q, k, v and the tensors right after them (masked's mask) share a dtype; a later one
    # (model's float32 sinks) is the shape rule's to check, as decode's int32 lengths are
    floats = [t for t in tensors[:spec.leading_tensors] if t.is_floating_point()]
    if dtype not in verified["dtypes"] or any(t.dtype != first.dtype for t in floats):
        return f"dtype {dtype} (verified: {', '.join(verified['dtypes'])}, all inputs alike)"
    if verified["head_dims"] and first.shape[-1] not in verified["head_dims"]:
        return (f"head dim {first.shape[-1]} (verified: "
                f"{', '.join(map(str, verified['head_dims']))})")
    if any(t.numel() == 0 for t in tensors):
        return "an empty input"
    if any(t.numel() >= INT32_ELEMENTS for t in tensors):
        return "an input of 2**31 elements or more"
    for name, value in spec.flags(args).items():
        allowed = verified.get(name)
        if allowed is not None and value not in allowed:
            return f"{name}={value} (verified: {allowed})"
    return spec.shape_refusal(args)
