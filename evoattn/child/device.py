"""Facts about the device the child runs on: name, versions, peaks, memory poisoning."""
from __future__ import annotations

from typing import Any

# Datasheet dense peaks in TFLOP/s: (fp16/bf16 tensor core, fp32 CUDA core). Matched by substring.
_PEAKS = [
    ("H200", (989.4, 66.9)), ("H100 PCIe", (756.0, 51.2)), ("H100", (989.4, 66.9)),
    ("H800", (989.4, 66.9)), ("GH200", (989.4, 66.9)), ("B200", (2250.0, 80.0)),
    ("A100", (312.0, 19.5)), ("A800", (312.0, 19.5)), ("L40S", (362.1, 91.6)),
    ("L40", (181.0, 90.5)), ("L4", (121.0, 30.3)), ("A10", (125.0, 31.2)),
    ("RTX 4090", (165.2, 82.6)), ("RTX 3090", (71.0, 35.6)), ("V100", (125.0, 15.7)),
]

# Datasheet memory bandwidth in TB/s (HBM), matched by substring in this order: what a
# bandwidth-bound kernel (decode) is measured against.
_HBM_TBPS = [
    ("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35), ("H800", 3.35),
    ("GH200", 4.0), ("B200", 8.0), ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935),
    ("A100", 1.555), ("L40S", 0.864), ("L4", 0.3), ("A10", 0.6), ("RTX 4090", 1.008),
]


def hbm_tbps(name: str) -> float | None:
    """Returns the datasheet memory bandwidth (TB/s) of a device by its name, if known."""
    return next((bw for key, bw in _HBM_TBPS if key in name), None)


def versions() -> dict[str, str]:
    """Returns torch/triton/CUDA versions as strings."""
    import platform

    import torch
    v = {"torch": torch.__version__, "python": platform.python_version(),
         "cuda": str(torch.version.cuda)}
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = "absent"
    return v


def describe(device: str) -> dict[str, Any]:
    """Returns name, SM count, shared memory per block and datasheet peaks of the device."""
    import torch
    if device == "cpu":
        import platform
        return {"name": f"cpu ({platform.processor() or platform.machine()})", "peak_fp16": None,
                "peak_fp32": None}
    p = torch.cuda.get_device_properties(0)
    peaks = next((pk for key, pk in _PEAKS if key in p.name), (None, None))
    return {"name": p.name, "sm_count": p.multi_processor_count,
            "capability": f"{p.major}.{p.minor}",
            "smem_per_block_optin": getattr(p, "shared_memory_per_block_optin", None),
            "l2_bytes": getattr(p, "L2_cache_size", None),
            "total_mem_bytes": p.total_memory,
            "peak_fp16": peaks[0], "peak_fp32": peaks[1]}


def peak_for(info: dict[str, Any], dtype: str) -> float | None:
    """Returns the datasheet peak TFLOP/s for a dtype."""
    return info.get("peak_fp32") if dtype == "float32" else info.get("peak_fp16")


def measured_matmul_tflops(dtype: Any, n: int = 8192, reps: int = 5) -> float:
    """Returns the measured TFLOP/s of an n³ matmul: the GPU's practical ceiling."""
    import torch
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(2):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.matmul(a, b)
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e))
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n ** 3 / (best * 1e-3) / 1e12


def poison_allocator(sizes_bytes: list[int], copies: int = 4) -> None:
    """Fills freed caching-allocator blocks of the given sizes with NaN, so leftovers hold no answer."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    budget = int(free * 0.25)
    held = []
    for size in sorted(set(sizes_bytes), reverse=True):
        for _ in range(copies):
            if size > budget:
                break
            budget -= size
            held.append(torch.full((max(1, size // 2),), float("nan"), dtype=torch.float16,
                                   device="cuda"))
    torch.cuda.synchronize()
    del held  # blocks return to the cache, NaN-filled
