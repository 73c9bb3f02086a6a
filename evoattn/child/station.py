"""`python -m evoattn.child.station`: a run's warm, trusted process on one GPU (or the CPU).

It never runs candidate code. It measures what every candidate of a run would otherwise
measure again in its own process: the GPU's matmul ceiling (once) and the baselines' times
in every mode (FlexAttention compiled once, cuDNN's per-shape plans built once), which the
parent hands to each candidate's child in its request. Candidates are still timed alone in
their own process; the parent re-times the baselines here between candidates when its times
grow old (evoattn/station.py), so both see the GPU at nearly the same moment.

Protocol, one JSON object per line:
    parent -> station   {"op": "setup", "request": EvalRequest}   {"op": "time"}
    station -> parent   {"ok": true, ...} | {"ok": false, "error": "..."}
    setup's answer: {"ok", "ceiling_tflops"}; time's: {"ok", "baseline_times":
    {config key: {baseline name: Times}}, "seconds"}
"""
from __future__ import annotations

import json
import random
import sys
import time
from typing import Any


class _Station:
    """The measuring side: a problem's configs, their inputs, and a timer."""

    def __init__(self, request: Any) -> None:
        import torch

        from . import device as devinfo
        from .preparation import trusted_compile_caches
        from ..problems import get_problem
        from .cpu_pin import TimingCpu
        from .timing import CpuTimer, GpuTimer
        self.req = request
        self.problem = get_problem(request.problem)
        on_gpu = request.on_gpu
        self.device = torch.device(request.device)
        dtype_name = request.dtype or self.problem.default_dtype
        self.dtype = getattr(torch, dtype_name)
        self.configs = [dict(c) for c in (request.configs or (
            self.problem.default_configs if on_gpu else self.problem.cpu_configs))]
        self.rng = random.Random(time.time_ns())
        self.ceiling = None
        if on_gpu and self.dtype != torch.float32:
            self.ceiling = devinfo.measured_matmul_tflops(self.dtype)
        self.timer = GpuTimer(request.cache_dir or None) if on_gpu else CpuTimer()
        self.cpu = TimingCpu(request.timing_cpus) if on_gpu and request.pin_cpu else None
        self.baselines = self.problem.baselines()
        self.cases = []
        with trusted_compile_caches(request.cache_dir):
            for cfg in self.configs:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(self.rng.getrandbits(62))
                inputs = self.problem.make_inputs(cfg, self.dtype, self.device, gen)
                for fn in self.baselines.values():      # compiles, builds plans: warm-up only
                    fn(inputs, cfg)
                self.cases.append((cfg, inputs, gen))

    def time(self) -> dict[str, dict[str, Any]]:
        out = {}
        if self.cpu is not None:        # timed on the CPU a candidate's child picks (the fastest)
            self.cpu.pick()
        try:
            for cfg, inputs, gen in self.cases:
                if self.cpu is not None:
                    self.cpu.refresh()
                out.update(self._time_config(cfg, inputs, gen))
        finally:
            if self.cpu is not None:
                self.cpu.release()
        return out

    def _time_config(self, cfg: dict[str, Any], inputs: Any, gen: Any) -> dict[str, Any]:
        from .measure import (CONTENTION_PAUSE_S, CONTENTION_TRIES, applies, bind, config_key,
                              disturbance)
        from .timing import Plan, set_bytes
        fns = {n: bind(f, cfg) for n, f in self.baselines.items() if applies(f, cfg)}
        plan = Plan.for_device(self.req.on_gpu, self.req.resolved_warmup(),
                               self.req.resolved_reps(),
                               set_bytes(inputs, self.problem.random_inputs), self.req.timing,
                               heat=self.req.heat)
        for attempt in range(CONTENTION_TRIES):       # a disturbed reading: measured again
            m = self.timer.measure(fns, inputs, self.problem.random_inputs,
                                   lambda inp, g=gen: self.problem.refill(inp, g), plan, "",
                                   self.rng)
            if disturbance(m.times, self.req.on_gpu) is None:
                break
            if attempt < CONTENTION_TRIES - 1:
                time.sleep(CONTENTION_PAUSE_S)
        return {config_key(cfg): {n: t.to_json() for n, t in m.times.items()}}


def main() -> None:
    from ..contract.request import EvalRequest
    from .worker import die_with_parent
    die_with_parent(int(sys.argv[sys.argv.index("--parent") + 1]))
    station: _Station | None = None
    out = sys.stdout
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            if msg["op"] == "setup":
                station = _Station(EvalRequest.from_json(msg["request"]))
                reply: dict[str, Any] = {"ok": True, "ceiling_tflops": station.ceiling}
            elif msg["op"] == "time" and station is not None:
                t0 = time.perf_counter()
                reply = {"ok": True, "baseline_times": station.time(),
                         "seconds": round(time.perf_counter() - t0, 3)}
            else:
                reply = {"ok": False, "error": f"unexpected message {msg.get('op')!r}"}
        except Exception as e:  # noqa: BLE001 - answer with the cause; the parent decides
            reply = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
