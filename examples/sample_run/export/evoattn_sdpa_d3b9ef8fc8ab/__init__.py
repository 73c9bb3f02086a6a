"""An attention kernel evolved by evoattn, as a PyTorch custom op (see README.md).

    from PACKAGE import attention            # the op's Python entry, like SDPA
    torch.ops.NAMESPACE.attention            # the same op, for graphs and compile
    from PACKAGE import hf; hf.register()    # Hugging Face: attn_implementation="evoattn"

`stats()` counts calls that ran the kernel and calls that fell back (to PyTorch SDPA, or to a
model's eager attention for a feature SDPA lacks), by reason;
`use_kernel(False)` or `with kernel_off():` makes every call fall back (to time the kernel's
own share of a model);
`call_path()` says whether eager calls run their per-call work in C++ yet (built in the
background from the first call; `call_path(wait_s=None)` waits for it);
`VERIFIED` is what the kernel was verified on (device, capability, dtypes, head dims).
"""
from __future__ import annotations

from typing import Any

from . import _loader, hf
from .ops import (META, NAMESPACE, attention, call_path, kernel_enabled, kernel_off,
                  reset_stats, stats, use_kernel)

VERIFIED: dict[str, Any] = META["verified"]
PROBLEM: str = META["problem"]
PROGRAM_ID: str = META["program_id"]


def load_kernel_module(libraries: dict[str, str] | None = None) -> Any:
    """Returns the kernel's Python main file as a module (Python-form kernels only)."""
    if META["form"] != "python":
        raise TypeError(f"the kernel is a {META['form']} CUDA file, not a Python module")
    return _loader.import_main(META, libraries)


__all__ = ["attention", "call_path", "hf", "stats", "reset_stats", "use_kernel", "kernel_off", "kernel_enabled",
           "load_kernel_module", "VERIFIED", "PROBLEM", "PROGRAM_ID", "NAMESPACE", "META"]
