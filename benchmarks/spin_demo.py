#!/usr/bin/env python3
"""Times two side-stream cheats and honest kernels under three timer spins, in one process (GPU).

Three spins, each queued by GpuTimer.run after its device sync: the one-thread spin
(`torch.cuda._sleep`, the timer's spin until the fourth session), the full-GPU spin launched
through Triton (its first form in that session), and the timer's spin as it is (the same
kernel replayed from a CUDA graph). For each function this prints the median event time per
call under each spin, side by side:
  * tests/adversarial/gpu_side_stream_hidden.py: its side work (~0.2 ms of sleep, then the
    math) should be hidden under the one-thread spin and timed under the others;
  * tests/adversarial/gpu_spin_hook.py: its Triton launch hook starts the work before a
    Triton-launched spin, so it should be hidden there and timed under the graph replay;
  * the run's best flash_triton kernel and SDPA: honest times (and their ratio) should not
    move with the spin.
    python benchmarks/spin_demo.py [--json out.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from evaluator.timing import SPIN_NS, GpuTimer  # noqa: E402

CHEAT = ROOT / "tests" / "adversarial" / "gpu_side_stream_hidden.py"
HOOK = ROOT / "tests" / "adversarial" / "gpu_spin_hook.py"
BEST = ROOT / "benchmarks" / "results" / "2026-11-22-h200-s2" / "best" / "best.py"
SHAPES = [(2, 4, 512, 64, False), (8, 32, 512, 64, False), (1, 32, 4096, 64, True)]


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load(path: Path):
    return load_module(path).attention


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    cheat, best, hook_mod = load(CHEAT), load(BEST), load_module(HOOK)
    import triton
    hooks = triton.knobs.runtime.launch_enter_hook
    timer = GpuTimer()
    full_spin = timer.spin
    one_thread = lambda: torch.cuda._sleep(2 * SPIN_NS)   # noqa: E731 (~2 cycles per ns)
    spins = (("one_thread", one_thread), ("full_gpu_triton_launch", full_spin._launch),
             ("full_gpu_graph", full_spin))
    rows = []
    for B, H, S, D, causal in SHAPES:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
        inputs = {"q": q, "k": k, "v": v}
        scale = D ** -0.5

        def refill(inp):
            for t in inp.values():
                t.normal_()
        # each cheat on its own: their side streams and big float32 temporaries would disturb
        # the honest pair's timing if interleaved with it; the hook only while its cheat runs
        groups = [{"best": lambda i: best(i["q"], i["k"], i["v"], causal, scale),
                   "sdpa": lambda i: F.scaled_dot_product_attention(
                       i["q"], i["k"], i["v"], is_causal=causal, scale=scale)},
                  {"cheat": lambda i: cheat(i["q"], i["k"], i["v"], causal, scale)},
                  {"hook_cheat": lambda i: hook_mod.attention(i["q"], i["k"], i["v"], causal,
                                                              scale)}]
        for spin_name, spin in spins:
            timer.spin = spin
            ms = {}
            for fns in groups:
                if "hook_cheat" in fns and hook_mod._side is not None:
                    hooks.add(hook_mod._on_launch)
                try:
                    ms.update(timer.run(fns, inputs, refill, warmup=3, reps=args.reps,
                                        keep_reps=set(), keep_name="").ms)
                finally:
                    hooks.remove(hook_mod._on_launch)
                    hook_mod._state.clear()
            row = {"shape": [B, H, S, D, causal], "spin": spin_name,
                   **{f"{n}_ms": round(v, 4) for n, v in ms.items()},
                   "best_vs_sdpa": round(ms["sdpa"] / ms["best"], 4)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "spin_ns": SPIN_NS, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
