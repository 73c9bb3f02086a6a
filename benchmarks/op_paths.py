"""An exported op's call paths side by side in one process, against SDPA (GPU only).

    python -m benchmarks.op_paths --export DIR [--rounds 9] [--json F]
    python -m benchmarks.op_paths --export DIR --cpu-tensors [--rounds 15]   # any machine

The cross-check of op_calls.py by other means: per config (two launch-bound ones, both causal
values and dtypes) it times SDPA and `attention()` on its C++ call path and on its Python path,
with the kernel and with it switched off (the fallback), the paths switched per timing, in
interleaved rounds (the order reversed every other round): host µs per call from a plain loop
of 400 calls with the GPU held busy, and GPU time per call from `triton.testing.do_bench`. It
prints each row and, per path, the median over rows of the host µs over SDPA.

--cpu-tensors times the fallback's host work alone, with no CUDA launch to vary: SDPA and
`attention()` (every call refused, so SDPA behind it) on (1, 1, 1, 8) CPU tensors, one thread,
mean µs of 20,000 calls per timing, the paths in interleaved rounds; per causal value and path,
the median over rounds of op − SDPA. Run it on the packages to compare, one process each.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import interleaved_samples
from benchmarks.hf_model import load_export

PATHS = ("sdpa", "kernel_native", "kernel_python", "fallback_native", "fallback_python")
CONFIGS = ((1, 8, 512, 64), (8, 32, 512, 64))
CPU_PATHS = ("sdpa", "fallback_native", "fallback_python")
CPU_CALLS = 20_000


def host_us(fn, n: int = 400) -> float:  # noqa: ANN001
    """Host time of one call (µs), the mean of n calls queued behind a sleep kernel (its own
    loop and estimator, not host_cost.host_us's median of 40: this script cross-checks that
    one's figures)."""
    import torch
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e8))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


def cpu_rows(pkg, ops, native, rounds: int) -> list[dict]:  # noqa: ANN001
    """The --cpu-tensors rows: op − SDPA host µs per call on tiny CPU tensors."""
    import gc

    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)
    rows = []
    for causal in (True, False):
        q, k, v = (torch.randn(1, 1, 1, 8) for _ in range(3))
        sdpa = F.scaled_dot_product_attention
        fns = {"sdpa": lambda: sdpa(q, k, v, is_causal=causal),
               "op": lambda: pkg.attention(q, k, v, causal=causal)}
        def one(n: str) -> float:
            ops._native_call = native if n.endswith("native") else None
            fn = fns["sdpa" if n == "sdpa" else "op"]
            fn(), fn()
            t0 = time.perf_counter()
            for _ in range(CPU_CALLS):
                fn()
            return (time.perf_counter() - t0) / CPU_CALLS * 1e6
        gc.disable()
        try:
            times = interleaved_samples({n: n for n in CPU_PATHS}, one, rounds)
        finally:
            gc.enable()
            ops._native_call = native
        row = {"cfg": [1, 1, 1, 8, causal], "dtype": "float32", "sdpa_us": statistics.median(
            times["sdpa"])}
        for n in CPU_PATHS[1:]:
            row[n] = {"host_minus_sdpa": statistics.median(
                [x - y for x, y in zip(times[n], times["sdpa"])])}
        rows.append(row)
        print(f"cpu tensors, causal={causal}: SDPA {row['sdpa_us']:.2f} us; op - SDPA "
              + " ".join(f"{n} {row[n]['host_minus_sdpa']:+.2f}" for n in CPU_PATHS[1:]),
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json")
    ap.add_argument("--cpu-tensors", action="store_true",
                    help="time the fallback's host work on CPU tensors (no GPU needed)")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from evoattn.child.cpu_pin import TimingCpu
    pkg = load_export(str(a.export))
    ops = sys.modules[f"{pkg.__name__}.ops"]
    path = pkg.call_path(wait_s=None)
    if path != "native":
        raise SystemExit(f"the C++ call path is not available ({path}): nothing to compare")
    native = ops._native_call
    print(f"pinned to CPU {TimingCpu().pick()}")
    if a.cpu_tensors:
        pkg.use_kernel(False)
        try:
            rows = cpu_rows(pkg, ops, native, a.rounds)
        finally:
            pkg.use_kernel(True)
        if a.json:
            Path(a.json).write_text(json.dumps({"package": pkg.__name__, "rows": rows,
                                                "torch": torch.__version__}, indent=1))
        return
    rows = []
    try:
        for dtype in (torch.float16, torch.bfloat16):
            for B, H, S, D in CONFIGS:
                for causal in (True, False):
                    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype)
                               for _ in range(3))

                    def sdpa() -> torch.Tensor:
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                    def op() -> torch.Tensor:
                        return pkg.attention(q, k, v, causal=causal)

                    def one(n: str) -> tuple[float, float]:
                        pkg.use_kernel(not n.startswith("fallback"))
                        ops._native_call = native if n.endswith("native") else None
                        fn = sdpa if n == "sdpa" else op
                        fn(), fn()
                        return host_us(fn), do_bench(fn, warmup=25, rep=100) * 1e3
                    samples = interleaved_samples({n: n for n in PATHS}, one, a.rounds)
                    times = {n: {"host": [h for h, _ in s], "bench": [b for _, b in s]}
                             for n, s in samples.items()}
                    row = {"cfg": [B, H, S, D, causal], "dtype": str(dtype).split(".")[1]}
                    for n in PATHS:
                        row[n] = {m: statistics.median(x) for m, x in times[n].items()}
                        if n != "sdpa":
                            row[n]["host_minus_sdpa"] = statistics.median(
                                [x - y for x, y in zip(times[n]["host"], times["sdpa"]["host"])])
                    rows.append(row)
                    print(f"{row['dtype']:9} {str(row['cfg']):26} host us over SDPA "
                          f"({row['sdpa']['host']:.1f}): "
                          + " ".join(f"{n} {row[n]['host_minus_sdpa']:+.2f}" for n in PATHS[1:])
                          + " | do_bench us: "
                          + " ".join(f"{n} {row[n]['bench']:.1f}" for n in PATHS), flush=True)
    finally:
        pkg.use_kernel(True)
        ops._native_call = native
    for n in PATHS[1:]:
        d = [r[n]["host_minus_sdpa"] for r in rows]
        print(f"{n}: host us over SDPA, median over rows {statistics.median(d):+.2f} "
              f"({min(d):+.2f} to {max(d):+.2f})")
    if a.json:
        Path(a.json).write_text(json.dumps({"package": pkg.__name__, "rows": rows,
                                            "device": torch.cuda.get_device_name(),
                                            "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
