"""Correctness checks: output validity, error against the reference, untouched inputs."""
from __future__ import annotations

from typing import Any


def output_problem(out: Any, like: Any) -> str | None:
    """Returns why `out` is not an acceptable output shaped like `like`, or None."""
    import torch
    if type(out) is not torch.Tensor:
        return (f"output must be a plain torch.Tensor, got {type(out).__module__}."
                f"{type(out).__qualname__}")
    if out.layout is not torch.strided or out.is_nested:
        return f"output must be a dense strided tensor, got layout {out.layout}"
    if tuple(out.shape) != tuple(like.shape):
        return f"output shape {tuple(out.shape)} != expected {tuple(like.shape)}"
    if out.dtype != like.dtype:
        return f"output dtype {out.dtype} != expected {like.dtype}"
    if out.device != like.device:
        return f"output device {out.device} != expected {like.device}"
    if out.numel() and not out.is_contiguous() and out.stride(-1) != 1:
        return "output must be dense (last dimension contiguous)"
    return None


def max_abs_err(out: Any, ref: Any) -> float:
    """Returns max |out - ref| in float32 (inf when out has NaN/Inf)."""
    import torch
    if out.numel() == 0:
        return 0.0 if bool(torch.isfinite(out).all()) else float("inf")
    # One pass and one synchronisation: out is promoted to float32 inside the subtraction.
    err = float(torch.sub(ref.float(), out).abs_().amax())
    if err == err:
        return err                     # inf where either holds an Inf
    return float("inf") if not bool(torch.isfinite(out).all()) else err


def inputs_changed(pointers: list[int], tensors: list[Any], clones: list[Any]) -> str | None:
    """Returns which input was replaced (data pointer moved) or modified (vs exact clones), or None."""
    import torch
    for i, (t, c) in enumerate(zip(tensors, clones)):
        if t.data_ptr() != pointers[i]:
            return f"input {i} was replaced"
        if not torch.equal(t, c):
            return f"input {i} was modified in place"
    return None
