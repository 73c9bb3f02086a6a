"""`python -m evoattn.child.baseline`: times every baseline and backend of a problem (trusted code).

Request JSON on stdin ({problem, configs, dtype, device, reps, warmup}); prints one JSON
line `{"device": ..., "versions": ..., "rows": [{"cfg", "flops", "times": {name: Times|None}}]}`
with every timing mode per implementation (evoattn/child/timing.py).
"""
from __future__ import annotations

import json
import random
import sys


def main() -> None:
    req = json.loads(sys.stdin.read())
    import torch

    from . import device as devinfo
    from .measure import applies, bind
    from ..problems import get_problem
    from ..contract.request import EvalRequest
    from .timing import CpuTimer, GpuTimer, Plan, set_bytes

    problem = get_problem(req["problem"])
    dev = req["device"]
    defaults = EvalRequest(device=dev)          # the same warm-up and rounds as every timing
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
        fns = {**problem.baselines(), **problem.extra_baselines()}
        plan = Plan.for_device(on_gpu, int(req.get("warmup") or defaults.resolved_warmup()),
                               int(req.get("reps") or defaults.resolved_reps()),
                               set_bytes(inputs, problem.random_inputs), "all")
        times: dict[str, dict | None] = {}
        for name, fn in fns.items():
            if not applies(fn, cfg):
                times[name] = None
                continue
            bound = bind(fn, cfg)
            try:
                bound(inputs)                          # unsupported configs raise here
                m = timer.measure({name: bound}, inputs, problem.random_inputs,
                                  lambda inp: problem.refill(inp, gen), plan, "", rng)
                times[name] = m.times[name].to_json()
            except Exception:  # noqa: BLE001 - a backend that does not support this config
                times[name] = None
            if on_gpu:
                torch.cuda.empty_cache()
        rows.append({"cfg": cfg, "flops": problem.flops(cfg), "times": times})
    print(json.dumps({"device": devinfo.describe(dev)["name"], "versions": devinfo.versions(),
                      "rows": rows}))


if __name__ == "__main__":
    main()
