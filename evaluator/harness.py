"""The evaluation inside the child: scan, build, baselines, reference, (its turn on a shared
GPU: evaluator/gpu_turn.py) guard, import, check, time. A run's spare child does the
candidate-independent part (prepare) first, before it is told its candidate.

Order matters for integrity: references, tolerance probes, the baselines' compiled code and
the GPU's ceiling all exist before the candidate is imported; freed device memory is then
poisoned with NaN; guards are installed; only then does candidate code run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from . import device as devinfo, guards, snapshot
from .cases import Case, prepare_case
from .checking import Checked, Fail, check_all, library_kernels
from .cpu_pin import TimingCpu
from .gpu_turn import GpuTurn
from .loader import LoadFailure, Loaded, build_candidate, loaded_module
from .measure import TimingContext, time_case
from .names import Stage
from .problems import get_problem
from .problems.base import Problem, Tolerance
from .program import declared_companions
from .request import EvalRequest
from . import scoring
from .scoring import fitness
from .timing import CpuTimer, GpuTimer, LazyOutput
from .types import ConfigResult, EvalResult, Verdict

_now = time.perf_counter
Report = Callable[[str], None]     # reports the stage an evaluation enters


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
    timer. A run's spare child (evaluator/worker.py) makes it while another candidate is
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
    s = s or _setup(req)
    # The baselines' set-up (cuDNN's plans, FlexAttention's compiles: seconds of CPU work)
    # before this evaluation's turn on a shared GPU, so that it overlaps another's turn.
    sync = _sync(req)
    # In steps: between two, another evaluation's timing that is due goes first.
    stage(Stage.BASELINES)
    baselines = _warm_baselines(s, lambda: turn.step(sync, Stage.BASELINES))
    stage(Stage.REFERENCE)
    rng = random.Random(int(req.secret_seed))
    cases = _cases(s, rng, s.dtype_name, lambda: turn.step(sync, Stage.REFERENCE))
    # Checked only, after the timed dtype passes; their references also exist before any
    # candidate code runs.
    others = {d: _cases(s, rng, d, lambda: turn.step(sync, Stage.REFERENCE))
              for d in s.dtypes[1:]}
    # Binds the clocks before any candidate code. Before the poisoning: setting up the GPU spin
    # captures a CUDA graph, and torch empties the allocator cache when a capture begins.
    stage(Stage.TIMER)
    timer = GpuTimer(req.cache_dir or None) if req.on_gpu else CpuTimer()
    turn.set_up(sync)
    return Prepared(turn, s, baselines, rng, cases, others, timer)


def evaluate(req: EvalRequest, stage: Report, prepared: Prepared | None = None) -> EvalResult:
    """Returns the verdict on the candidate the request names; `prepared`: what a spare child
    set up for it before it was named (for a request whose same_set_up(req) holds)."""
    turn: GpuTurn | None = None
    if prepared is not None:
        if not prepared.s.req.same_set_up(req):
            return EvalResult.failure(Verdict.EVALUATOR_FAULT, "the spare process was prepared "
                                      "for another request", problem=req.problem)
        prepared.turn.report = stage
        s = _named(prepared.s, req)
    else:
        turn = GpuTurn(req.gpu_lock, stage)    # before CUDA starts here
        s = _setup(req)
    bad = _static_scan(s)
    if bad:
        return bad
    stage(Stage.BUILD)
    if turn is not None:        # a fresh child: its build (CPU only) holds no lock
        turn.aside(_sync(req))
    rival_loader = None
    try:
        if req.rival:
            rival_loader = build_candidate(Path(req.rival), s.problem, Path(req.cache_dir),
                                           req.build_timeout_s, req.arch, req.facts)
    except LoadFailure as e:
        return s.fail(Verdict.EVALUATOR_FAULT, f"the rival does not build: {e.reason}",
                      build_log=e.log)
    try:
        loader = build_candidate(Path(req.candidate), s.problem, Path(req.cache_dir),
                                 req.build_timeout_s, req.arch, req.facts)
    except LoadFailure as e:
        verdict = Verdict.BUILD_ERROR if e.kind == "build" else Verdict.LOAD_ERROR
        return s.fail(verdict, e.reason, build_log=e.log)
    if prepared is None:
        assert turn is not None
        turn.resume(Stage.BUILD)
        prepared = prepare(req, stage, turn, s)
    turn, baselines, rng, timer = prepared.turn, prepared.baselines, prepared.rng, prepared.timer
    cases, others = prepared.cases, prepared.others
    turn.take(Stage.CEILING)
    ceiling = _ceiling(s, turn)
    cpu = TimingCpu(req.timing_cpus) if req.on_gpu and req.pin_cpu else None
    if req.on_gpu:
        devinfo.poison_allocator([c.out_bytes for c in cases + sum(others.values(), [])])
    turn.install_compile_hooks()
    guard = _Guard.install(s)
    stage(Stage.LOAD)
    rival = None
    if rival_loader is not None:
        # The rival first, then a snapshot of it: a candidate that replaces the rival's
        # functions to slow it down is caught as tampering, as with the harness's own.
        try:
            rival = guard.runner(rival_loader())
        except LoadFailure as e:
            return s.fail(Verdict.EVALUATOR_FAULT, f"the rival does not load: {e.reason}")
        guard.watch(loaded_module(Path(req.rival)))
    try:
        loaded = loader()
    except LoadFailure as e:
        verdict = Verdict.COMPILED if e.kind == "compiled" else Verdict.LOAD_ERROR
        return s.fail(verdict, e.reason, build_log=e.log)
    s.common.update(build_log=loaded.build_log, build_cached=loaded.build_cached,
                    build_seconds=loaded.build_seconds)
    run = guard.runner(loaded)
    bad = guard.integrity()
    if bad:
        return s.fail(*bad)
    stage(Stage.CHECK)
    turn.checking = True
    checked = _check(s, guard, run, s.dtype_name, cases)
    bad = _check_failure(s, s.dtype_name, checked)
    for dtype_name, dtype_cases in others.items():     # a candidate is correct in each or none
        bad = bad or _check_failure(s, dtype_name,
                                    _check(s, guard, run, dtype_name, dtype_cases))
    if bad:
        return bad
    others.clear()                  # their inputs and references: memory the timing may need
    if rival is not None:
        rival_checked = _check(s, guard, rival, s.dtype_name, cases)
        if rival_checked.failed:
            return s.fail(Verdict.EVALUATOR_FAULT, "the rival is not correct on these inputs: "
                          f"{rival_checked.failed[1]}")
    turn.checking = False
    turn.take(Stage.TIME if not req.check_only else Stage.CHECK)     # back from a compile's yield
    if req.check_only:
        return _profile(s, guard, cases, run, stage) or EvalResult(
            Verdict.PASS, "correct (not timed)", 0.0, checked.results[:len(s.configs)],
            duration_s=_now() - s.t_start, **s.common)
    extra = s.problem.extra_baselines() if req.all_backends else {}
    turn.timing()
    cpu = _timing_cpu(s, cpu)
    if cpu is not None:
        timer.on_busy_host = cpu.pick
    ctx = TimingContext(s.problem, req, timer, s.tol, s.dtype_name,
                        devinfo.peak_for(s.info, s.dtype_name), ceiling, baselines, extra,
                        host_slowed=cpu.slowed if cpu is not None else None)
    try:
        timed = _time_all(s, ctx, cases, checked, run, rng, guard, rival,
                          cpu.refresh if cpu is not None else None)
    finally:
        if cpu is not None:
            cpu.release()
    # what was measured again: call rounds whose launches lost their CPU, configs whose
    # baselines' times showed a disturbance (measure.py)
    again = {k: v for k, v in (("call_rounds_redone", timer.rounds_redone),
                               ("configs_remeasured", dict(ctx.remeasured))) if v}
    if again:
        timed = dataclasses.replace(timed, device_info={**timed.device_info, **again})
    turn.release()                  # the profile below is one call: the next one may begin
    # The profiler runs after timing: once torch.profiler has run in a process, every later
    # launch costs about 20 µs more host time (CUPTI stays subscribed; measured on an H100,
    # benchmarks/protocol_check.py --stages plain,profiled), which timing would count.
    return (_profile(s, guard, cases, run, stage) or timed) if timed.correct else timed


def _setup(req: EvalRequest) -> Setup:
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


def _named(s: Setup, req: EvalRequest) -> Setup:
    """Returns a spare's set-up for the candidate `req` names, its clock starting now."""
    path = Path(req.candidate).resolve()
    return dataclasses.replace(s, req=req, root=path.parent,
                               common={**s.common, "candidate": path.name,
                                       "timing": req.timing, "baseline": req.baseline,
                                       "device_info": dict(s.common["device_info"])},
                               t_start=_now())


def _static_scan(s: Setup) -> EvalResult | None:
    """Refuses library attention in any of the candidate's files (no candidate code runs)."""
    if s.req.policy != "kernel-only":
        return None
    main = Path(s.req.candidate)
    uses = []
    for f in [main] + [main.parent / c.name for c in declared_companions(main.read_text(
            errors="replace"))]:
        if f.is_file():
            uses += guards.scan_source(f.read_text(errors="replace"))
    if uses:
        return s.fail(Verdict.POLICY, "library attention under the kernel-only policy: "
                      + "; ".join(dict.fromkeys(uses)) +
                      " (set evaluator.policy: allow-library to permit)")
    return None


def _cases(s: Setup, rng: random.Random, dtype_name: str,
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


def _check(s: Setup, guard: "_Guard", run: Callable[..., Any], dtype_name: str,
           cases: list[Case]) -> Checked:
    """Checks every case of one dtype."""
    return check_all(cases, dtype_name, run, s.req.on_gpu, s.root, s.req.policy == "kernel-only",
                     guard.violations, guard.integrity, s.req.screen)


def _check_failure(s: Setup, dtype_name: str, checked: Checked) -> EvalResult | None:
    """Returns the failure of one dtype's checks (naming the dtype when several are checked)."""
    if not checked.failed:
        return None
    verdict, reason = checked.failed
    if len(s.dtypes) > 1:
        reason = f"{dtype_name}: {reason}"
    return s.fail(verdict, reason, configs=checked.results[:len(s.configs)])


def _warm_baselines(s: Setup, between: Callable[[], None] = lambda: None
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


def _sync(req: EvalRequest) -> Callable[[], None]:
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


def _ceiling(s: Setup, turn: GpuTurn) -> float | None:
    """The GPU's measured matmul ceiling (given by the request: a run's seed measured it for
    the later candidates), else measured here, alone on a shared GPU (as a timing: a spare's
    set-up beside it would make it read low, and the implausibility check rests on it)."""
    import torch
    if not s.req.on_gpu or s.dtype == torch.float32:
        return None
    ceiling = s.req.ceiling_tflops
    if not ceiling:
        with turn.alone():
            ceiling = devinfo.measured_matmul_tflops(s.dtype)
    s.common["device_info"]["measured_matmul_tflops"] = round(ceiling, 1)
    return ceiling


class _Guard:
    """The guards around candidate calls, and the integrity check that reads them."""

    def __init__(self, violations: guards.Violations, lib_guard: Any,
                 tampered: Callable[[], list[str]]) -> None:
        self.violations, self.lib_guard, self._tampered = violations, lib_guard, tampered
        self._watched: list[Callable[[], list[str]]] = []

    @classmethod
    def install(cls, s: Setup) -> "_Guard":
        violations = guards.Violations()
        kernel_only = s.req.policy == "kernel-only"
        lib_guard = guards.install_library_guard(violations) if kernel_only else None
        import evaluator.cases, evaluator.checking, evaluator.measure  # noqa: E401,F401
        import evaluator.checks, evaluator.hidden_work, evaluator.scoring  # noqa: E401,F401
        if s.req.on_gpu:
            import evaluator.spin  # noqa: F401  (watched from here on)
        # Every evaluator module loaded by now (the stages above, types, request, the
        # problems and their FlexAttention baselines, ...), and the problem's own module.
        mods = [m for n, m in sorted(sys.modules.items())
                if m is not None and (n == "evaluator" or n.startswith("evaluator."))]
        if sys.modules[type(s.problem).__module__] not in mods:     # a user problem's file
            mods.append(sys.modules[type(s.problem).__module__])
        # Held in this object only: a candidate that replaces guards' functions cannot blind it.
        tampered = snapshot.harness_snapshot(mods)
        allowed = list(s.req.allowed_dirs) or [str(s.root)]
        guards.install_sandbox(violations, allowed)
        return cls(violations, lib_guard, tampered)

    def watch(self, module: Any) -> None:
        """Adds a loaded program's module to what the tamper check covers."""
        if module is not None:
            self._watched.append(snapshot.harness_snapshot([module]))

    def integrity(self) -> tuple[Verdict, str] | None:
        changed = self._tampered() + [n for w in self._watched for n in w()]
        if changed:
            return Verdict.TAMPERING, "replaced harness functions: " + ", ".join(changed[:5])
        return self.violations.first()

    def runner(self, loaded: Loaded) -> Callable[[dict[str, Any], dict[str, Any]], Any]:
        lib_guard = self.lib_guard

        def run(inputs: dict[str, Any], cfg: dict[str, Any]) -> Any:
            if lib_guard:
                lib_guard.arm()
            try:
                return loaded.run(inputs, cfg)
            finally:
                if lib_guard:
                    lib_guard.disarm()
        return run


def _profile(s: Setup, guard: _Guard, cases: list[Case], run: Callable[..., Any],
             stage: Report) -> EvalResult | None:
    """On a GPU, under kernel-only: the kernels one call launches must not be library attention."""
    if not (s.req.on_gpu and s.req.policy == "kernel-only"):
        return None
    stage(Stage.PROFILE)
    try:
        found = library_kernels(lambda: run(cases[0].trials[0].inputs, cases[0].cfg))
    except BaseException as e:  # noqa: BLE001 - the candidate's failure is data
        return s.fail(*(guard.violations.first() or (Verdict.CRASH, "raised under the profiler: "
                                                     f"{type(e).__name__}: {e}"[:300])))
    if found:
        return s.fail(Verdict.POLICY, "launched library attention kernels: "
                      + ", ".join(sorted(found)[:3]))
    return None


def _timing_cpu(s: Setup, cpu: TimingCpu | None) -> TimingCpu | None:
    """Pins this thread to the fastest CPU of its set for the timing, and records which in
    the result's device_info; None where nothing is pinned."""
    if cpu is None or cpu.pick() is None:
        return None
    s.common["device_info"].update(timing_cpu=cpu.cpu, cpus_probed=len(cpu.probe),
                                   cpu_speed_spread=round(cpu.spread(), 3),
                                   cpu_probe_us=round(cpu.probe[cpu.cpu] * 1e6, 1))
    return cpu


def _time_all(s: Setup, ctx: TimingContext, cases: list[Case], checked: Checked,
              run: Callable[..., Any], rng: random.Random, guard: _Guard,
              rival: Callable[..., Any] | None = None,
              before_config: Callable[[], Any] | None = None) -> EvalResult:
    """Times every benchmark config; any failure ends the evaluation with its verdict.
    `before_config` runs before each (the timing CPU's check)."""
    import torch
    out: list[ConfigResult] = []
    flags: list[str] = []
    for i, case in enumerate(cases[:len(s.configs)]):
        label = s.problem.label(case.cfg)
        t_config = _now()                  # its timing CPU's check included
        if before_config is not None:
            before_config()
        try:
            out.append(dataclasses.replace(
                time_case(ctx, case, run, rng, checked.results[i], flags, rival),
                timing_s=round(_now() - t_config, 4)))
        except Fail as f:
            return s.fail(f.verdict, f"{label}: {f.reason}", configs=tuple(out),
                          flags=tuple(flags))
        except BaseException as e:  # noqa: BLE001 - SystemExit from a candidate too
            bad = guard.integrity()   # a tripwire or sandbox refusal is the cause, not a crash
            if bad:
                return s.fail(*bad, configs=tuple(out), flags=tuple(flags))
            if isinstance(e, LazyOutput):
                return s.fail(Verdict.HIDDEN_WORK, f"{label}: {e}", configs=tuple(out),
                              flags=tuple(flags))
            first = str(e).splitlines()[0] if str(e) else ""
            if isinstance(e, torch.OutOfMemoryError):
                return s.fail(Verdict.OOM, f"{label}: out of memory while timing: {first}",
                              configs=tuple(out))
            return s.fail(Verdict.CRASH, f"{label}: raised while timing: "
                          f"{type(e).__name__}: {first[:300]}", configs=tuple(out))
        bad = guard.integrity()
        if bad:
            return s.fail(*bad, configs=tuple(out), flags=tuple(flags))
    score = fitness(out)
    reason = "all configs correct"
    missing = [c for c in out if c.ms is None]
    if missing:
        reason += (f"; no {s.req.timing} time for {len(missing)} config(s): "
                   f"{missing[0].times.graph_error if missing[0].times else ''}")
    duel: dict[str, Any] = {}
    if rival is not None:
        rf, rf_ci = scoring.rival_fitness(out, s.req.timing)
        g, g_ci = scoring.gain(out)
        duel = dict(rival=Path(s.req.rival).name, rival_fitness=rf, rival_fitness_ci=rf_ci,
                    gain=g, gain_ci=g_ci)
    return EvalResult(Verdict.PASS, reason, score, tuple(out), flags=tuple(flags),
                      fitness_ci=scoring.fitness_ci(out), duration_s=_now() - s.t_start,
                      **duel, **s.common)

