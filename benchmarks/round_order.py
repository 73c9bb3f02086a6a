"""What a function's place in a round does to its call time: SDPA timed against itself.

    python -m benchmarks.round_order [--configs "8,32,512,64,nc;1,8,512,64,causal"]
                                     [--rounds 30] [--repeats 2] [--out order.json]

Two copies of `F.scaled_dot_product_attention` (cuDNN on Hopper) are timed by the evaluator's
own call mode (evoattn/child/timing.py: back-to-back calls on rotating input sets, host clock,
their order reversed every round) for --rounds rounds, with nothing, a stopping rule's
arithmetic (each copy's median interval and their ratio's: three bootstraps), or a 3-ms sleep
between rounds (`none`, `rule`, `sleep`), and with a 2-ms sleep before every batch (`both`:
the same pause before either copy). Configs as `evoattn eval --configs` reads them for sdpa.
The copies are the same
function, so any difference between the rounds in which copy A ran first and those in which B
did is the position's. Prints, per config and pause, the median of copy B's time over A's in
each kind of round, the gap between them, and the ratio over single rounds and over pairs of
rounds (what the evaluator counts), each with its 95% interval. GPU only (exits 2 without).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


PAUSES = ("none", "rule", "sleep", "both")
DEFAULT = "8,32,512,64,nc;4,32,1024,64,nc;16,16,1024,128,nc;1,8,512,64,nc;2,32,2048,64,causal"


def parse_configs(text: str) -> list[tuple[int, int, int, int, bool]]:
    """(B, H, S, D, causal) per config of `text`, read by the sdpa problem's own parser."""
    from evoattn.problems import get_problem
    return [(c["B"], c["H"], c["S"], c["D"], bool(c["causal"]))
            for c in get_problem("sdpa").parse_configs(text)]


def one(timer, cfg, pause: str, rounds: int) -> dict:  # noqa: ANN001
    import torch
    import torch.nn.functional as F

    from evoattn.contract import stats

    from evoattn.child import timing
    from evoattn.child.timing import InputSets, Plan
    b, h, s, d, causal = cfg
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    inputs = {n: torch.randn(b, h, s, d, device="cuda", dtype=torch.float16, generator=gen)
              for n in "qkv"}

    def refill(x: dict) -> None:
        for n in "qkv":
            x[n].normal_()

    def copy(x: dict):  # noqa: ANN202
        return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=causal)
    fns = {"A": copy, "B": lambda x: copy(x)}
    real_adapt, real_refill = timing.adapt, InputSets.refill

    def adapt(mode, names, plan, converged, one_round):  # noqa: ANN001, ANN202
        samples = {n: [] for n in names}
        order = list(names)
        for r in range(rounds):
            if pause == "sleep":
                time.sleep(0.003)
            one_round(r, order, samples)
            if pause == "rule":       # the default rule's arithmetic: three bootstraps
                timing.own_width(mode, samples)
                stats.ratio(samples["B"], samples["A"], paired=True)
            order.reverse()
        return samples

    def refill_then_pause(sets: InputSets) -> None:
        real_refill(sets)
        if pause == "both":
            torch.cuda.synchronize()
            time.sleep(0.002)
    timing.adapt, InputSets.refill = adapt, refill_then_pause
    try:
        plan = Plan.for_device(True, 10, rounds, sum(t.numel() * 2 for t in inputs.values()),
                               heat=False)
        per_call = statistics.median(timer._host_per_call(copy, inputs, refill)[0]
                                     for _ in range(3))
        sets = InputSets(inputs, ("q", "k", "v"), plan.call_sets(per_call), refill, refill)
        got, _ = timer._call_mode(fns, sets, plan, "", random.Random(0), [], None, per_call)
    finally:
        timing.adapt, InputSets.refill = real_adapt, real_refill
    by_round = [bt / at for at, bt in zip(got["A"], got["B"])]
    a_first, b_first = statistics.median(by_round[0::2]), statistics.median(by_round[1::2])
    single = statistics.median(by_round), stats.median_ci(by_round)
    paired = stats.ratio(got["B"], got["A"], paired=True)
    return {"config": list(cfg), "pause": pause, "per_call_us": per_call * 1e3,
            "b_over_a_when_a_first": a_first, "b_over_a_when_b_first": b_first,
            "gap": max(a_first, b_first) / min(a_first, b_first) - 1,
            "single_rounds": [single[0], single[1]], "pairs": [paired[0], paired[1]],
            "A_ms": got["A"], "B_ms": got["B"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=DEFAULT,
                    help='"B,H,S,D[,causal|nc];..." (without the fifth field: both)')
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pauses", default=",".join(PAUSES))
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    pauses = [p for p in a.pauses.split(",") if p]
    bad = [p for p in pauses if p not in PAUSES]
    if bad or a.rounds < 4:
        why = (f"--pauses: no pause named {bad[0]!r} (one of {', '.join(PAUSES)})" if bad
               else "--rounds: at least 4 (two pairs)")
        print(f"round_order.py: {why}", file=sys.stderr)
        sys.exit(2)
    try:
        configs = parse_configs(a.configs)
    except ValueError as e:
        print(f"round_order.py: --configs: {e}", file=sys.stderr)
        sys.exit(2)
    import torch
    if not torch.cuda.is_available():
        print("round_order.py: no CUDA GPU here", file=sys.stderr)
        sys.exit(2)
    from evoattn.child.timing import GpuTimer
    timer = GpuTimer(tempfile.mkdtemp(prefix="evoattn-order-"))
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B over A (the same "
          "function): median in rounds where A ran first / where B did, their gap; the ratio "
          "over single rounds and over pairs, with 95% intervals")
    for rep in range(a.repeats):
        for cfg in configs:
            for pause in pauses:
                r = one(timer, cfg, pause, a.rounds)
                rows.append(r)
                (s, s_ci), (p, p_ci) = r["single_rounds"], r["pairs"]
                print(f"{rep} {str(cfg):30s} {pause:5s} {r['b_over_a_when_a_first']:.4f} / "
                      f"{r['b_over_a_when_b_first']:.4f} gap {r['gap']:6.2%}  single {s:.4f} "
                      f"[{s_ci[0]:.4f}, {s_ci[1]:.4f}]  pairs {p:.4f} [{p_ci[0]:.4f}, "
                      f"{p_ci[1]:.4f}]  {r['per_call_us']:.1f} µs/call", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                           "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
