"""The evaluation inside the child, as a list of stages: scan, build, set-up (baselines,
references, timer, its turn on a shared GPU: evoattn/child/gpu_turn.py, the guards), load, check,
time. A run's spare child does the candidate-independent set-up (evoattn/child/preparation.py)
first, before it is told its candidate.

Order matters for integrity: references, tolerance probes, the baselines' compiled code and
the GPU's ceiling all exist before the candidate is imported; freed device memory is then
poisoned with NaN; guards are installed; only then does candidate code run.
"""
from __future__ import annotations

import dataclasses
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

from . import device as devinfo, guards, snapshot
from .cases import Case
from .checking import Checked, Fail, check_all, library_kernels
from .cpu_pin import TimingCpu
from .gpu_turn import GpuTurn, Report
from .loader import LoadFailure, Loaded, build_candidate, loaded_module
from .measure import TimingContext, time_case
from ..contract.names import Stage
from .preparation import Prepared, Setup, device_sync, named, prepare, setup
from ..contract.program import declared_companions
from ..contract.request import EvalRequest
from ..contract import scoring
from ..contract.scoring import fitness
from .timing import LazyOutput
from ..contract.types import ConfigResult, EvalResult, Verdict

_now = time.perf_counter
Run = Callable[[dict[str, Any], dict[str, Any]], Any]      # a program's call: (inputs, config)

# the project's own modules a candidate's process loads (snapshotted against tampering)
TRUSTED_PACKAGES = ("evoattn.child", "evoattn.contract", "evoattn.problems")


@dataclasses.dataclass
class _Evaluation:
    """One evaluation as its stages fill it in (inside the child; it crosses no boundary)."""

    req: EvalRequest
    report: Report
    s: Setup
    turn: GpuTurn | None = None                 # a fresh child's own, until its set-up
    prepared: Prepared | None = None
    loader: Callable[[], Loaded] | None = None
    rival_loader: Callable[[], Loaded] | None = None
    ceiling: float | None = None
    cpu: TimingCpu | None = None                # the timing CPU to pin (on a GPU)
    guard: "_Guard | None" = None
    run: Run | None = None
    rival: Run | None = None
    checked: Checked | None = None


def evaluate(req: EvalRequest, stage: Report, prepared: Prepared | None = None) -> EvalResult:
    """Returns the verdict on the candidate the request names; `prepared`: what a spare child
    set up for it before it was named (for a request whose same_set_up(req) holds)."""
    e = _begin(req, stage, prepared)
    if isinstance(e, EvalResult):
        return e
    # each stage returns None to go on, or the result that ends the evaluation
    for step in (_scan, _build, _set_up, _load, _check):
        end = step(e)
        if end is not None:
            return end
    return _time(e)


def _begin(req: EvalRequest, stage: Report, prepared: Prepared | None
           ) -> _Evaluation | EvalResult:
    if prepared is None:
        turn = GpuTurn(req.gpu_lock, stage)    # before CUDA starts here
        return _Evaluation(req, stage, setup(req), turn=turn)
    if not prepared.s.req.same_set_up(req):
        return EvalResult.failure(Verdict.EVALUATOR_FAULT, "the spare process was prepared "
                                  "for another request", problem=req.problem)
    prepared.turn.report = stage
    return _Evaluation(req, stage, named(prepared.s, req), prepared=prepared)


def _scan(e: _Evaluation) -> EvalResult | None:
    return _static_scan(e.s)


def _build(e: _Evaluation) -> EvalResult | None:
    """Builds the rival (a duel's) and the candidate: CPU work, no candidate code runs."""
    req, s = e.req, e.s
    e.report(Stage.BUILD)
    if e.turn is not None:      # a fresh child: its build (CPU only) holds no lock
        e.turn.aside(device_sync(req))
    try:
        if req.rival:
            e.rival_loader = build_candidate(Path(req.rival), s.problem, Path(req.cache_dir),
                                             req.build_timeout_s, req.arch, req.facts)
    except LoadFailure as err:
        return s.fail(Verdict.EVALUATOR_FAULT, f"the rival does not build: {err.reason}",
                      build_log=err.log)
    try:
        e.loader = build_candidate(Path(req.candidate), s.problem, Path(req.cache_dir),
                                   req.build_timeout_s, req.arch, req.facts)
    except LoadFailure as err:
        verdict = Verdict.BUILD_ERROR if err.kind == "build" else Verdict.LOAD_ERROR
        return s.fail(verdict, err.reason, build_log=err.log)
    return None


def _set_up(e: _Evaluation) -> None:
    """Prepares (a fresh child; a spare did before), takes the GPU's turn, measures its
    ceiling, poisons freed device memory and installs the guards."""
    req, s = e.req, e.s
    if e.prepared is None:
        assert e.turn is not None
        e.turn.resume(Stage.BUILD)
        e.prepared = prepare(req, e.report, e.turn, s)
    p = e.prepared
    p.turn.take(Stage.CEILING)
    e.ceiling = _ceiling(s, p.turn)
    e.cpu = TimingCpu(req.timing_cpus) if req.on_gpu and req.pin_cpu else None
    if req.on_gpu:
        devinfo.poison_allocator([c.out_bytes for c in p.cases + sum(p.others.values(), [])])
    p.turn.install_compile_hooks()
    e.guard = _Guard.install(s)


def _load(e: _Evaluation) -> EvalResult | None:
    """Imports the rival, then the candidate: the first candidate code that runs."""
    req, s, guard = e.req, e.s, e.guard
    assert guard is not None and e.loader is not None
    e.report(Stage.LOAD)
    if e.rival_loader is not None:
        # The rival first, then a snapshot of it: a candidate that replaces the rival's
        # functions to slow it down is caught as tampering, as with the harness's own.
        try:
            e.rival = guard.runner(e.rival_loader())
        except LoadFailure as err:
            return s.fail(Verdict.EVALUATOR_FAULT, f"the rival does not load: {err.reason}")
        guard.watch(loaded_module(Path(req.rival)))
    try:
        loaded = e.loader()
    except LoadFailure as err:
        verdict = Verdict.COMPILED if err.kind == "compiled" else Verdict.LOAD_ERROR
        return s.fail(verdict, err.reason, build_log=err.log)
    s.common.update(build_log=loaded.build_log, build_cached=loaded.build_cached,
                    build_seconds=loaded.build_seconds)
    e.run = guard.runner(loaded)
    bad = guard.integrity()
    return s.fail(*bad) if bad else None


def _check(e: _Evaluation) -> EvalResult | None:
    """Checks the candidate in every dtype (and a duel's rival in the timed one); a check-only
    request ends here."""
    req, s, p, guard, run = e.req, e.s, e.prepared, e.guard, e.run
    assert p is not None and guard is not None and run is not None
    e.report(Stage.CHECK)
    p.turn.checking = True
    e.checked = _check_dtype(s, guard, run, s.dtype_name, p.cases)
    bad = _check_failure(s, s.dtype_name, e.checked)
    for dtype_name, dtype_cases in p.others.items():   # a candidate is correct in each or none
        bad = bad or _check_failure(s, dtype_name,
                                    _check_dtype(s, guard, run, dtype_name, dtype_cases))
    if bad:
        return bad
    p.others.clear()                # their inputs and references: memory the timing may need
    if e.rival is not None:
        rival_checked = _check_dtype(s, guard, e.rival, s.dtype_name, p.cases)
        if rival_checked.failed:
            return s.fail(Verdict.EVALUATOR_FAULT, "the rival is not correct on these inputs: "
                          f"{rival_checked.failed[1]}")
    p.turn.checking = False
    if not req.check_only:
        return None
    p.turn.take(Stage.CHECK)        # back from a compile's yield
    return _profile(s, guard, p.cases, run, e.report) or EvalResult(
        Verdict.PASS, "correct (not timed)", 0.0, e.checked.results[:len(s.configs)],
        duration_s=_now() - s.t_start, **s.common)


def _time(e: _Evaluation) -> EvalResult:
    """Times every config on the GPU's turn (the timing CPU pinned), then profiles a correct
    candidate's launches."""
    req, s, p, guard, run = e.req, e.s, e.prepared, e.guard, e.run
    assert p is not None and guard is not None and run is not None and e.checked is not None
    p.turn.take(Stage.TIME)         # back from a compile's yield
    extra = s.problem.extra_baselines() if req.all_backends else {}
    p.turn.timing()
    cpu = _timing_cpu(s, e.cpu)
    if cpu is not None:
        p.timer.on_busy_host = cpu.pick
    ctx = TimingContext(s.problem, req, p.timer, s.tol, s.dtype_name,
                        devinfo.peak_for(s.info, s.dtype_name), e.ceiling, p.baselines, extra,
                        host_slowed=cpu.slowed if cpu is not None else None)
    try:
        timed = _time_all(s, ctx, p.cases, e.checked, run, p.rng, guard, e.rival,
                          cpu.refresh if cpu is not None else None)
    finally:
        if cpu is not None:
            cpu.release()
    # what was measured again: call rounds whose launches lost their CPU, configs whose
    # times showed a disturbance (measure.py)
    again = {k: v for k, v in (("call_rounds_redone", p.timer.rounds_redone),
                               ("configs_remeasured", dict(ctx.remeasured))) if v}
    if again:
        timed = dataclasses.replace(timed, device_info={**timed.device_info, **again})
    p.turn.release()                # the profile below is one call: the next one may begin
    # The profiler runs after timing: once torch.profiler has run in a process, every later
    # launch costs about 20 µs more host time (CUPTI stays subscribed; measured on an H100,
    # benchmarks/protocol_check.py --stages plain,profiled), which timing would count.
    return (_profile(s, guard, p.cases, run, e.report) or timed) if timed.correct else timed


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


def _check_dtype(s: Setup, guard: "_Guard", run: Callable[..., Any], dtype_name: str,
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
        import evoattn.child.cases, evoattn.child.checking, evoattn.child.measure  # noqa: E401,F401
        import evoattn.child.checks, evoattn.child.hidden_work, evoattn.contract.scoring  # noqa: E401,F401
        if s.req.on_gpu:
            import evoattn.child.spin  # noqa: F401  (watched from here on)
        # Every evaluator module loaded by now (the stages above, types, request, the
        # problems and their FlexAttention baselines, ...), and the problem's own module.
        mods = [m for n, m in sorted(sys.modules.items())
                if m is not None and n.startswith(TRUSTED_PACKAGES)]
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

