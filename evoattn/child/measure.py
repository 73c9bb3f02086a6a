"""The timing stage of one config: time it (and its baselines), re-check the timed outputs,
catch hidden work, re-verify implausible speed, and score it.

Baselines are timed side by side in this process unless the request brings their times
(a run's station measured them in its own warm process: evoattn/station.py).
"""
from __future__ import annotations

import dataclasses
import json
import random
import time
from typing import Any, Callable

from ..contract import scoring
from . import checks
from .cases import Case, fresh_bound
from .checking import Fail, Meta
from ..problems.base import Problem, Tolerance
from ..contract.request import EvalRequest
from .hidden_work import hidden_work
from .timing import Plan, set_bytes
from ..contract.types import ConfigResult, Times, Verdict

Fn = Callable[[dict[str, Any]], Any]


def config_key(cfg: dict[str, Any]) -> str:
    """Returns the key of a config in a request's `baseline_times`."""
    return json.dumps(cfg, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class TimingContext:
    """What timing every config of one candidate shares."""

    problem: Problem
    req: EvalRequest
    timer: Any
    tol: Tolerance
    dtype_name: str
    peak_tflops: float | None
    ceiling_tflops: float | None
    baselines: dict[str, Callable[..., Any]]     # name -> fn(inputs, cfg), timed here if not given
    backends: dict[str, Callable[..., Any]]      # --all-backends diagnostics
    # config label -> why it was measured again (a disturbance its baselines' times show, or
    # its timing CPU slowed while a host-bound config was timed)
    remeasured: dict[str, str] = dataclasses.field(default_factory=dict)
    # says how much the timing CPU slowed since its pick, picking again (None: it did not);
    # None where no CPU is pinned (evoattn/child/cpu_pin.py)
    host_slowed: Callable[[], str | None] | None = None


def time_case(ctx: TimingContext, case: Case, run: Callable[..., Any], rng: random.Random,
              checked: ConfigResult, flags: list[str],
              rival: Callable[..., Any] | None = None) -> ConfigResult:
    """Returns the scored result of one config; raises Fail for a timing-stage verdict.

    `rival`: a second program timed in the same rounds (a duel); its times and the gain
    (rival time / candidate time) are added to the result."""
    problem, req, cfg = ctx.problem, ctx.req, case.cfg
    inputs = case.trials[0].inputs
    case.gen.manual_seed(rng.getrandbits(62))
    given = _given_times(req, cfg)
    fns: dict[str, Fn] = {"candidate": lambda inp: run(inp, cfg)}
    if given is None:
        fns.update({f"baseline:{n}": bind(f, cfg) for n, f in ctx.baselines.items()
                    if applies(f, cfg)})
    if req.all_backends:
        fns.update({f"backend:{n}": bind(f, cfg) for n, f in ctx.backends.items()
                    if _works(f, inputs, cfg)})
    if rival is not None:
        fns["rival"] = lambda inp: rival(inp, cfg)
    plan = Plan.for_device(req.on_gpu, req.resolved_warmup(), req.resolved_reps(),
                           set_bytes(inputs, problem.random_inputs), req.timing, req.width,
                           req.graph, req.heat)
    refill = lambda inp: problem.refill(inp, case.gen)     # noqa: E731
    # The default refill is elementwise (normal_): it can fill every input set in one launch.
    refill_all = refill if type(problem).refill is Problem.refill else None
    converged = scoring.converged_rule(req.baseline, plan.width, given, req.timing)
    for attempt in range(CONTENTION_TRIES):
        m = ctx.timer.measure(fns, inputs, problem.random_inputs, refill, plan, "candidate",
                              rng, converged, refill_all=refill_all)
        _recheck(problem, case, m.kept, ctx.tol)
        suspect = _hidden(m, "candidate") if req.on_gpu else None
        if suspect is None:
            why = disturbance(_baselines_here(m), req.on_gpu)
            pause = CONTENTION_PAUSE_S
            if why is None and ctx.host_slowed is not None and _host_bound(m):
                why, pause = ctx.host_slowed(), 0.0      # picked again: measured at once
            if why is None or attempt == CONTENTION_TRIES - 1:
                break
            ctx.remeasured[problem.label(cfg)] = why
            time.sleep(pause)
            continue
        busy = _contention(ctx, m, fns, inputs, refill, cfg)
        if busy is None:
            raise Fail(Verdict.HIDDEN_WORK, suspect)
        if attempt == CONTENTION_TRIES - 1:
            raise Fail(Verdict.EVALUATOR_FAULT, f"the GPU is busy with other work ({busy}); "
                       f"measured {CONTENTION_TRIES} times, no verdict on the candidate")
        time.sleep(CONTENTION_PAUSE_S)
    cand = m.times["candidate"]
    base = given if given is not None else {n.split(":", 1)[1]: t for n, t in m.times.items()
                                            if n.startswith("baseline:")}
    backends = {n.split(":", 1)[1]: t for n, t in m.times.items() if n.startswith("backend:")}
    base_mem = {n.split(":", 1)[1]: v for n, v in m.peak_mem_bytes.items()
                if n.startswith("baseline:")}
    flops = problem.flops(cfg)
    result = scoring.score(checked, cand, base, backends, req.timing, req.baseline, flops,
                           ctx.peak_tflops, m.peak_mem_bytes["candidate"], base_mem,
                           samples=m.samples, given=given is not None)
    if rival is not None:
        result = scoring.with_rival(result, m.times["rival"], m.samples, req.timing)
    _implausible(ctx, case, run, rng, result, scoring.tflops(flops, cand.kernel_ms), flags)
    return result


CONTENTION_TRIES = 3               # a config whose baseline also fails the cross-check: measured again
CONTENTION_PAUSE_S = 1.0


DISTURBED = 1.3                    # a baseline's modes disagree by more than this: measured again


def _baselines_here(m: Any) -> dict[str, Times]:
    """Returns the baselines' times measured here: trusted code, warmed on every config before
    any candidate ran (harness: a candidate's own first calls may still carry one-time costs,
    seen on the CPU as one call at 8.4 ms where back to back read 0.77 ms)."""
    return {n.split(":", 1)[1]: t for n, t in m.times.items() if n.startswith("baseline:")}


def disturbance(times: dict[str, Times], on_gpu: bool) -> str | None:
    """Returns what functions' own times show of a disturbance while they were timed
    (another process on the GPU or the CPU, a stall of the host), or None.

    On a GPU, in a steady state a function's GPU time per call (kernel mode) is not above its
    back-to-back time per call (call mode), and where its host cost is well under its GPU time,
    its back-to-back time is about its GPU time. Seen on an H100: both modes' medians of one
    config 12-16x their usual value in one evaluation, and call times 1.5-1.9x with kernel
    times unmoved in another. On the CPU both modes time the same host work by the host clock,
    one after the other (evoattn/child/timing.py), so either above the other shows it: seen on a
    loaded 2-core machine, SDPA read 6-19 ms where it reads 0.12-0.2 ms quiet."""
    for name, t in times.items():
        if not t.kernel_ms or not t.call_ms:
            continue
        one = "GPU time" if on_gpu else "one call"
        if t.kernel_ms > DISTURBED * t.call_ms:
            return (f"{name}: {one} {t.kernel_ms:.4f} ms per call, above its back-to-back "
                    f"{t.call_ms:.4f} ms")
        # on a GPU, back-to-back calls may take their host cost where it exceeds the GPU time
        host_hidden = not on_gpu or (t.host_us is not None and
                                     t.host_us * 1e-3 < 0.5 * t.kernel_ms)
        if host_hidden and t.call_ms > DISTURBED * t.kernel_ms:
            host = f" and host {t.host_us:.1f} µs" if on_gpu else ""
            return (f"{name}: back to back {t.call_ms:.4f} ms per call, its {one} "
                    f"{t.kernel_ms:.4f} ms{host}")
    return None


def _host_bound(m: Any) -> bool:
    """Whether any function's call-mode time was set by the host (Times.host_bound): then
    the host's speed decides the ratio, and a slow host need not slow two launch paths alike
    while neither the busy-CPU nor the disturbance re-measure sees it (BENCHMARKS.md, "How
    far a figure can be trusted")."""
    return any(t.host_bound() for t in m.times.values())


def _hidden(m: Any, name: str) -> str | None:
    """Returns why a function's host time shows work its events missed (None if it does not)."""
    t = m.times[name]
    host, launch = m.host_ms_per_call.get(name), m.launch_ms.get(name, 0.0)
    if host is None or t.kernel_ms is None or not hidden_work(t.kernel_ms, host, launch):
        return None
    return (f"events timed {t.kernel_ms:.4f} ms and calls return in {launch:.4f} ms, but the "
            f"host saw {host:.4f} ms per call: work escaped the timer")


def _contention(ctx: TimingContext, m: Any, fns: dict[str, Fn], inputs: dict[str, Any],
                refill: Callable[[dict[str, Any]], None], cfg: dict[str, Any]) -> str | None:
    """Returns what shows that another process loads the GPU when a trusted baseline fails the
    same host-versus-events cross-check as the candidate (None when the baselines pass it).

    A cheat's hidden work slows its own calls only; a busy GPU slows everyone's. The baselines
    timed beside the candidate are checked; with baseline times from a run's station, the
    problem's first baseline is cross-checked here for the purpose."""
    names = [n for n in fns if n.startswith("baseline:")]
    if names:
        for n in names:
            why = _hidden(m, n)
            if why:
                return f"{n.split(':', 1)[1]}, trusted code, failed the cross-check too: {why}"
        return None
    name, base = next(iter((ctx.baselines or ctx.problem.baselines()).items()))
    event_ms, host_ms, launch_ms = ctx.timer.probe(bind(base, cfg), inputs, refill)
    if hidden_work(event_ms, host_ms, launch_ms):
        return (f"{name}, trusted code, failed the cross-check too: events timed "
                f"{event_ms:.4f} ms but the host saw {host_ms:.4f} ms per call")
    return None


def bind(fn: Callable[..., Any], cfg: dict[str, Any]) -> Fn:
    """Returns fn bound to a config; a baseline with `bind` prepares its per-config state
    (masks, compiled callables) once, outside the timed calls."""
    if hasattr(fn, "bind"):
        return fn.bind(cfg)
    return lambda inp: fn(inp, cfg)


def applies(fn: Callable[..., Any], cfg: dict[str, Any]) -> bool:
    """Returns whether a baseline computes this config: one whose `applies(cfg)` says no (SDPA
    for a soft-capped score) is not timed there, so no row stands for what it cannot do."""
    check = getattr(fn, "applies", None)
    return check is None or bool(check(cfg))


def _given_times(req: EvalRequest, cfg: dict[str, Any]) -> dict[str, Times] | None:
    if req.baseline_times is None:
        return None
    row = req.baseline_times.get(config_key(cfg))
    if row is None:
        raise Fail(Verdict.EVALUATOR_FAULT, "the run's station sent no baseline times for "
                   "this config")
    return {n: Times.from_json(t) for n, t in row.items()}


def _recheck(problem: Problem, case: Case, kept: list[Any], tol: Tolerance) -> None:
    """Re-checks kept timed outputs against references on the inputs they were computed from."""
    for k in kept:
        ref = problem.reference(k.inputs, case.cfg)
        bound = fresh_bound(problem, case, k.inputs, ref, tol)
        why = checks.output_problem(k.output, Meta(ref.shape, case.like.dtype, ref.device))
        err = float("inf") if why else checks.max_abs_err(k.output, ref)
        if err <= bound:
            continue
        if k.last_of_batch:
            raise Fail(Verdict.HIDDEN_WORK, f"{k.what}: the output was not finished after "
                       f"the batch (error {err:.3g} > {bound:.3g}): work deferred past the "
                       "timer, into a later call")
        raise Fail(Verdict.INCORRECT, f"{k.what} returned a wrong output "
                   f"({why or f'error {err:.3g} > {bound:.3g}'}): stale or cached result?")


def _implausible(ctx: TimingContext, case: Case, run: Callable[..., Any], rng: random.Random,
                 result: ConfigResult, kernel_tflops: float | None, flags: list[str]) -> None:
    """Flags speed beyond physics (GPU only) and re-verifies it on fresh inputs.

    On the CPU a speedup says nothing about physics (the interpreter against PyTorch's CPU
    kernels), so nothing is flagged there.
    """
    if not ctx.req.on_gpu:
        return
    ceiling = ctx.ceiling_tflops
    over_ceiling = bool(ceiling and kernel_tflops and kernel_tflops > 1.05 * ceiling)
    if not over_ceiling and not (result.speedup or 0) > ctx.problem.implausible_speedup:
        return
    flags.append(f"{ctx.problem.label(case.cfg)}: implausible {result.speedup or 0:.1f}x / "
                 f"{kernel_tflops or 0:.0f} TFLOP/s, re-verified")
    _reverify(ctx.problem, case, run, rng, ctx.tol)
    if over_ceiling:
        raise Fail(Verdict.IMPLAUSIBLE, f"{kernel_tflops:.0f} TFLOP/s exceeds the measured "
                   f"ceiling {ceiling:.0f} TFLOP/s")


def _reverify(problem: Problem, case: Case, run: Callable[..., Any], rng: random.Random,
              tol: Tolerance) -> None:
    """Re-checks an implausibly fast candidate on fresh inputs; raises Fail if wrong."""
    from .timing import LazyOutput, plain
    import torch
    for _ in range(2):
        case.gen.manual_seed(rng.getrandbits(62))
        inputs = case.trials[0].inputs
        problem.refill(inputs, case.gen)
        ref = problem.reference(inputs, case.cfg)
        bound = fresh_bound(problem, case, inputs, ref, tol)
        out = run(inputs, case.cfg)
        try:
            plain("candidate", out, torch.Tensor)
        except LazyOutput as e:
            raise Fail(Verdict.HIDDEN_WORK, str(e)) from None
        why = checks.output_problem(out, Meta(ref.shape, case.like.dtype, ref.device))
        err = float("inf") if why else checks.max_abs_err(out, ref)
        if not err <= bound:
            raise Fail(Verdict.IMPLAUSIBLE, f"implausibly fast and wrong on fresh inputs "
                       f"(error {err:.3g})")


def _works(fn: Callable[..., Any], inputs: dict[str, Any], cfg: dict[str, Any]) -> bool:
    try:
        fn(inputs, cfg)
        return True
    except Exception:  # noqa: BLE001 - a backend that does not support this config
        return False
