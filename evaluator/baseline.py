"""`python -m evaluator.baseline`: times every PyTorch implementation of a problem (trusted code).

Request JSON on stdin ({problem, configs, dtype, device, reps, warmup}); prints
one JSON line `{"device": ..., "rows": [{"cfg", "flops", "ms": {name: ms|None}}]}`.
"""
from __future__ import annotations

import json
import random
import sys


def main() -> None:
    req = json.loads(sys.stdin.read())
    import torch

    from . import device as devinfo
    from .problems import get_problem
    from .timing import CpuTimer, GpuTimer

    problem = get_problem(req["problem"])
    dev = req["device"]
    on_gpu = dev == "cuda"
    dtype = getattr(torch, req.get("dtype") or problem.default_dtype)
    configs = req.get("configs") or (problem.default_configs if on_gpu else problem.cpu_configs)
    timer = GpuTimer() if on_gpu else CpuTimer()
    rng = random.Random(0)
    rows = []
    for cfg in configs:
        gen = torch.Generator(device=dev)
        gen.manual_seed(rng.getrandbits(62))
        inputs = problem.make_inputs(cfg, dtype, torch.device(dev), gen)
        fns = {"default": lambda inp, c=cfg: problem.baseline(inp, c)}
        fns.update({n: (lambda f, c=cfg: (lambda inp: f(inp, c)))(f)
                    for n, f in problem.extra_baselines().items()})
        ms: dict[str, float | None] = {}
        for name, fn in fns.items():
            try:
                t = timer.run({name: fn}, inputs, lambda inp: problem.refill(inp, gen),
                              int(req.get("warmup", 5 if on_gpu else 1)),
                              int(req.get("reps", 30 if on_gpu else 3)), set(), "")
                ms[name] = t.ms[name]
            except Exception:  # noqa: BLE001 - backend unsupported for this config
                ms[name] = None
            if on_gpu:
                torch.cuda.empty_cache()
        rows.append({"cfg": cfg, "flops": problem.flops(cfg), "ms": ms})
    print(json.dumps({"device": devinfo.describe(dev)["name"], "versions": devinfo.versions(),
                      "rows": rows}))


if __name__ == "__main__":
    main()
