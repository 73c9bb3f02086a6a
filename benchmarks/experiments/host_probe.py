"""How fast each CPU of this machine runs a launch-bound call's host work (GPU only).

    python -m benchmarks.experiments.host_probe [--rounds 6] [--json F]

Per CPU the process may use, this thread pinned to it: the host time of one SDPA call at
(1,8,512,64) causal while the GPU is held busy (a sleep kernel queued first, so only the CPU's
work is seen), a plain eager loop of the same calls, and the interpreter probe the evaluator
picks its timing CPU by (evoattn/child/cpu_pin.py). Prints them side by side, and the CPU the
probe would pick, so that one can see whether the probe ranks the CPUs as the calls do.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from benchmarks.common import host_us
from benchmarks.protocol_check import per_call_loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from evoattn.child.cpu_pin import TimingCpu, interpreter_work, median_seconds
    q = torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)

    def call(_: object = None) -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)

    for _ in range(50):
        call()
    torch.cuda.synchronize()
    saved = os.sched_getaffinity(0)
    rows = []
    for cpu in sorted(saved):
        os.sched_setaffinity(0, {cpu})
        probe = median_seconds(interpreter_work) * 1e6
        h = statistics.median(host_us(call) for _ in range(a.rounds))
        e = per_call_loop(call, [None], 300, a.rounds, torch.cuda.synchronize)
        rows.append({"cpu": cpu, "probe_us": probe, "host_us": h, "eager_us": e})
        print(f"cpu {cpu:3d}  probe {probe:7.1f} us  SDPA host {h:6.1f} us  eager {e:6.1f} us",
              flush=True)
    os.sched_setaffinity(0, saved)
    picked = TimingCpu().pick()
    os.sched_setaffinity(0, saved)
    by_probe = sorted(rows, key=lambda r: r["probe_us"])
    print(f"the probe picks CPU {picked}; by the probe the fastest half has SDPA host "
          f"{statistics.median(r['host_us'] for r in by_probe[:len(rows) // 2 or 1]):.1f} us, "
          f"the slowest half "
          f"{statistics.median(r['host_us'] for r in by_probe[len(rows) // 2:]):.1f} us")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                            "picked": picked, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
