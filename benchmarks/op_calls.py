"""An exported package's op as a user calls it, against SDPA, per default sdpa config (GPU only).

    python -m benchmarks.op_calls --export DIR [--dtypes float16,bfloat16] [--layout bhsd|model]
                                  [--fallback] [--pin-cpu] [--do-bench] [--json F]

Imports the package from DIR (an `evoattn export` directory, or a run directory) and, per
default config and dtype, prints: the host time of one call while
the GPU is held busy (a sleep kernel queued first, so no call waits for the GPU), for
`attention()` and for `F.scaled_dot_product_attention`; the per-call time of back-to-back eager
calls on distinct inputs, for both (each the median of 5 rounds in which the two take turns); and how many calls ran the kernel. `--layout model` passes
transformers' layout: (B, S, H, D) storage viewed as (B, H, S, D), k and v with H/4 heads
(SDPA gets the same views, with enable_gqa). `--fallback` tells the package's guard that no
device may run the kernel, so every call takes the package's fallback as a refused call does:
what the fallback costs over SDPA itself. The package's C++ call path is built (or loaded from
its cache) before anything is timed; EVOATTN_NATIVE=0 times its Python path instead.
--do-bench adds the cross-check by another harness: `triton.testing.do_bench` of both on one
input set (L2 flushed before each call; GPU time, not the host's), in the same interleaved rounds.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import eager_ms, geomean, host_us, interleaved, label
from benchmarks.hf_model import load_export


def inputs(cfg: dict, dtype, layout: str, n: int) -> list[tuple]:  # noqa: ANN001
    """Returns n input sets (q, k, v) of a config in the layout asked for."""
    import torch
    B, H, S, D = cfg["B"], cfg["H"], cfg["S"], cfg["D"]
    kv = max(1, H // 4) if layout == "model" else H

    def one(heads: int) -> torch.Tensor:
        if layout == "model":
            return torch.randn(B, S, heads, D, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(B, heads, S, D, device="cuda", dtype=dtype)

    return [(one(H), one(kv), one(kv)) for _ in range(n)]


def time_config(pkg: Any, cfg: dict, dtype_name: str, a: argparse.Namespace) -> dict:
    """Returns one config's row: the op and SDPA, host µs and eager ms (and do_bench ms)."""
    import torch
    import torch.nn.functional as F
    causal = cfg["causal"]
    size = 3 * cfg["B"] * cfg["H"] * cfg["S"] * cfg["D"] * 2
    sets = inputs(cfg, getattr(torch, dtype_name), a.layout, max(4, min(32, 2 ** 28 // size)))
    q, k, v = sets[0]
    gqa = k.shape[1] != q.shape[1]

    def ours(s: tuple) -> torch.Tensor:
        return pkg.attention(*s, causal=causal)

    def sdpa(s: tuple) -> torch.Tensor:
        return F.scaled_dot_product_attention(*s, is_causal=causal, enable_gqa=gqa)

    pkg.reset_stats()
    ours(sets[0])
    torch.cuda.synchronize()
    served = pkg.stats()
    host = interleaved({"ours": lambda: ours((q, k, v)), "sdpa": lambda: sdpa((q, k, v))},
                       host_us)
    call = interleaved({"ours": ours, "sdpa": sdpa}, lambda f: eager_ms(f, sets, 3))
    row = {"cfg": cfg, "dtype": dtype_name, "layout": a.layout, "fallback": a.fallback,
           "kernel_calls": served["kernel"], "reasons": served["fallback_reasons"],
           "host_us": host["ours"], "sdpa_host_us": host["sdpa"],
           "call_ms": call["ours"], "sdpa_call_ms": call["sdpa"]}
    if a.do_bench:
        from triton.testing import do_bench
        bench = interleaved({"ours": lambda: ours((q, k, v)), "sdpa": lambda: sdpa((q, k, v))},
                            lambda f: do_bench(f, warmup=25, rep=100))
        row.update(bench_ms=bench["ours"], sdpa_bench_ms=bench["sdpa"])
    return row


def print_row(row: dict) -> None:
    """Prints one config's row."""
    print(f"{row['dtype']:8} {label('sdpa', row['cfg']):24} "
          f"{'kernel' if row['kernel_calls'] else 'fallback'}"
          f"  host {row['host_us']:6.1f} us (SDPA {row['sdpa_host_us']:5.1f}, "
          f"+{row['host_us'] - row['sdpa_host_us']:5.1f})  call {row['call_ms']:.4f} ms "
          f"(SDPA {row['sdpa_call_ms']:.4f}, x{row['sdpa_call_ms'] / row['call_ms']:.3f})"
          + (f"  do_bench x{row['sdpa_bench_ms'] / row['bench_ms']:.3f}"
             if "bench_ms" in row else ""), flush=True)


def print_summary(rows: list[dict], do_bench: bool) -> None:
    """Prints the geometric-mean speedups and the op's host µs over SDPA."""
    speed = [r["sdpa_call_ms"] / r["call_ms"] for r in rows]
    extra = [r["host_us"] - r["sdpa_host_us"] for r in rows]
    print(f"geomean speedup over SDPA (eager back-to-back): "
          f"{geomean(speed):.3f} over {len(rows)} rows; host us over SDPA: "
          f"median {statistics.median(extra):+.1f} ({min(extra):+.1f} to {max(extra):+.1f})")
    if do_bench:
        print(f"geomean speedup over SDPA (do_bench): "
              f"{geomean(r['sdpa_bench_ms'] / r['bench_ms'] for r in rows):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True, type=Path)
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--layout", choices=("bhsd", "model"), default="bhsd")
    ap.add_argument("--fallback", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--pin-cpu", action="store_true",
                    help="time on the fastest CPU, pinned, picked again before a config when it "
                         "has slowed (as the evaluator does)")
    ap.add_argument("--do-bench", action="store_true",
                    help="also time both with triton.testing.do_bench (GPU time per call)")
    a = ap.parse_args()
    import torch

    from evoattn.problems import get_problem
    pkg = load_export(str(a.export))
    if a.fallback:
        importlib.import_module(f"{pkg.__name__}.guard").KERNEL_DEVICE_TYPES = ()
    path = pkg.call_path(wait_s=None) if hasattr(pkg, "call_path") else "python"
    print(f"call path: {path}")
    cpu = None
    if a.pin_cpu:
        from evoattn.child.cpu_pin import TimingCpu
        cpu = TimingCpu()
        print(f"pinned to CPU {cpu.pick()} (the CPUs' speeds differ {cpu.spread():.2f}x)")
    rows = []
    for dtype_name in a.dtypes.split(","):
        for cfg in get_problem("sdpa").default_configs:
            if cpu is not None:
                cpu.refresh()
            rows.append(time_config(pkg, cfg, dtype_name, a))
            print_row(rows[-1])
    print_summary(rows, a.do_bench)
    if a.json:
        Path(a.json).write_text(json.dumps({"package": pkg.__name__, "call_path": path,
                                            "rows": rows,
                                            "device": torch.cuda.get_device_name(),
                                            "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
