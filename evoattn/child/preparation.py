"""An evaluation's candidate-independent set-up: its settings (Setup) and what it prepares
before any candidate code runs (Prepared: the GPU turn, the baselines' plans, the inputs and
references of every dtype, the timer). A run's spare child (evoattn/child/worker.py) prepares
while another candidate is evaluated, then waits to be told its candidate.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from . import device as devinfo
from .cases import Case, prepare_case
from .gpu_turn import GpuTurn, Report
from ..contract.names import Stage
from ..problems import get_problem
from ..problems.base import Problem, Tolerance
from ..contract.request import EvalRequest
from .timing import CpuTimer, GpuTimer
from ..contract.types import EvalResult, Verdict

_now = time.perf_counter


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every stage of one evaluation reads."""

    req: EvalRequest
    problem: Problem
    dtype: Any
    dtype_name: str                     # the timed dtype, the first of `dtypes`
    dtypes: tuple[str, ...]             # every dtype the candidate is checked in
    configs: tuple[dict[str, Any], ...]
    domain: tuple[dict[str, Any], ...]
    tol: Tolerance
    root: Path                          # the candidate's directory
    info: dict[str, Any]
    common: dict[str, Any]              # EvalResult fields every outcome carries
    t_start: float

    def fail(self, verdict: Verdict, reason: str, **kw: Any) -> EvalResult:
        fields = {**self.common, **kw}
        return EvalResult.failure(verdict, reason, duration_s=_now() - self.t_start, **fields)


@dataclasses.dataclass
class Prepared:
    """What an evaluation sets up before it needs its candidate: the GPU turn's locks, the
    baselines' plans and compiles, the cases (inputs and references, every dtype) and the
    timer. A run's spare child (evoattn/child/worker.py) makes it while another candidate is
    evaluated, then waits to be told its candidate."""

    turn: GpuTurn
    s: Setup
    baselines: dict[str, Callable[..., Any]]
    rng: random.Random
    cases: list[Case]
    others: dict[str, list[Case]]          # the other checked dtypes' cases
    timer: Any


def prepare(req: EvalRequest, stage: Report, turn: GpuTurn | None = None,
            s: Setup | None = None) -> Prepared:
    """Sets up everything that does not depend on the candidate, holding the set-up's shared
    lock on a shared GPU (never while another evaluation times), no candidate code loaded.
    `turn`, `s`: the evaluation's own, where it began before (its scan and build)."""
    turn = turn or GpuTurn(req.gpu_lock, stage)        # before CUDA starts here
    s = s or setup(req)
    # The baselines' set-up (cuDNN's plans, FlexAttention's compiles: seconds of CPU work)
    # before this evaluation's turn on a shared GPU, so that it overlaps another's turn.
    sync = device_sync(req)
    # In steps: between two, another evaluation's timing that is due goes first.
    stage(Stage.BASELINES)
    baselines = warm_baselines(s, lambda: turn.step(sync, Stage.BASELINES))
    stage(Stage.REFERENCE)
    rng = random.Random(int(req.secret_seed))
    cases = make_cases(s, rng, s.dtype_name, lambda: turn.step(sync, Stage.REFERENCE))
    # Checked only, after the timed dtype passes; their references also exist before any
    # candidate code runs.
    others = {d: make_cases(s, rng, d, lambda: turn.step(sync, Stage.REFERENCE))
              for d in s.dtypes[1:]}
    # Binds the clocks before any candidate code. Before the poisoning: setting up the GPU spin
    # captures a CUDA graph, and torch empties the allocator cache when a capture begins.
    stage(Stage.TIMER)
    timer = GpuTimer(req.cache_dir or None) if req.on_gpu else CpuTimer()
    turn.set_up(sync)
    return Prepared(turn, s, baselines, rng, cases, others, timer)


def setup(req: EvalRequest) -> Setup:
    import torch
    problem = get_problem(req.problem)
    dtypes = req.resolved_dtypes(problem.default_dtype)
    dtype_name = dtypes[0]
    configs = tuple(dict(c) for c in (req.configs or (problem.default_configs if req.on_gpu
                                                      else problem.cpu_configs)))
    domain = tuple(dict(c) for c in (problem.domain_configs if req.on_gpu
                                     else problem.cpu_domain_configs))
    own = problem.tolerance
    tol = Tolerance(factor=own.factor if req.tolerance_factor is None else req.tolerance_factor,
                    floor=own.floor if req.tolerance_floor is None else req.tolerance_floor,
                    max_abs=own.max_abs if req.max_abs is None else req.max_abs)
    path = Path(req.candidate).resolve()
    info = devinfo.describe(req.device)
    common = dict(problem=problem.name, dtypes=dtypes, timing=req.timing, baseline=req.baseline,
                  candidate=path.name, device=info["name"], timing_device=req.device,
                  versions=devinfo.versions(),
                  device_info={k: v for k, v in info.items() if k != "name"})
    return Setup(req, problem, getattr(torch, dtype_name), dtype_name, dtypes, configs, domain,
                 tol, path.parent, info, common, _now())


def named(s: Setup, req: EvalRequest) -> Setup:
    """Returns a spare's set-up for the candidate `req` names, its clock starting now."""
    path = Path(req.candidate).resolve()
    return dataclasses.replace(s, req=req, root=path.parent,
                               common={**s.common, "candidate": path.name,
                                       "timing": req.timing, "baseline": req.baseline,
                                       "device_info": dict(s.common["device_info"])},
                               t_start=_now())


def make_cases(s: Setup, rng: random.Random, dtype_name: str,
           between: Callable[[], None] = lambda: None) -> list[Case]:
    """Returns the benchmark configs, then the domain shapes, with inputs in one dtype
    (`between`: called after each)."""
    import torch
    device = torch.device(s.req.device)
    dtype = getattr(torch, dtype_name)
    out = []
    for i, cfg in enumerate(s.configs + s.domain):
        out.append(prepare_case(s.problem, cfg, i >= len(s.configs), dtype, device, rng,
                                s.req.trials, s.tol))
        between()
    return out


def warm_baselines(s: Setup, between: Callable[[], None] = lambda: None
                    ) -> dict[str, Callable[..., Any]]:
    """Calls each baseline once per timed config before any candidate code runs, so that what
    they compile (FlexAttention) or plan (cuDNN) is ready, and compiled into caches candidates
    cannot write. On inputs of their own (only shapes, dtypes and layouts matter here), made
    and freed one config at a time (`between`: called after each)."""
    if s.req.check_only or s.req.baseline_times is not None:
        return {}
    import torch
    baselines = s.problem.baselines()
    device = torch.device(s.req.device)
    gen = torch.Generator(device=device)
    with trusted_compile_caches(s.req.cache_dir):
        for cfg in s.configs:
            gen.manual_seed(0)
            inputs = s.problem.make_inputs(cfg, s.dtype, device, gen)
            for fn in baselines.values():
                fn(inputs, cfg)
            del inputs
            between()
    return baselines


def device_sync(req: EvalRequest) -> Callable[[], None]:
    """Returns the device-wide synchronisation (bound before any candidate code runs)."""
    if not req.on_gpu:
        return lambda: None
    import torch
    return torch.cuda.synchronize


@contextlib.contextmanager
def trusted_compile_caches(cache_dir: str) -> Iterator[None]:
    """Points Triton's and Inductor's caches at directories outside the candidate's sandbox
    (the shared Triton cache is writable by candidates: a poisoned kernel there could slow a
    baseline down), then back."""
    keep = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "baselines", "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "baselines", "inductor")
    try:
        yield
    finally:
        for k, v in keep.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
