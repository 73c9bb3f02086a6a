"""The evaluation sequence inside the child: build, reference, guard, import, check, time.

Order matters for integrity: references, tolerance probes and the GPU's
ceiling are computed *before* the candidate is imported; freed device memory is
then poisoned with NaN; guards are installed; only then does candidate code run.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

from . import checks, device as devinfo, guards
from .loader import LoadFailure, build_candidate
from .problems import get_problem
from .problems.base import Problem, Tolerance
from .timing import CpuTimer, GpuTimer, LazyOutput, hidden_work
from .types import ConfigResult, EvalResult, Verdict, geometric_mean

_now = time.perf_counter


class _Fail(Exception):
    """Ends checking of a config with a verdict (internal control flow only)."""

    def __init__(self, verdict: Verdict, reason: str, err: float | None = None) -> None:
        super().__init__(reason)
        self.verdict, self.reason, self.err = verdict, reason, err


def evaluate(req: dict[str, Any], stage: Callable[[str], None]) -> EvalResult:
    """Returns the verdict on the candidate described by the request."""
    t_start = _now()
    import torch

    problem = get_problem(req["problem"])
    dev = req["device"]
    dtype_name = req.get("dtype") or problem.default_dtype
    dtype = getattr(torch, dtype_name)
    on_gpu = dev == "cuda"
    configs = [dict(c) for c in (req.get("configs") or
                                 (problem.default_configs if on_gpu else problem.cpu_configs))]
    domain = [dict(c) for c in (problem.domain_configs if on_gpu else problem.cpu_domain_configs)]
    tol_req = req.get("tolerance") or {}
    tol = Tolerance(factor=tol_req.get("factor", problem.tolerance.factor),
                    floor=tol_req.get("floor", problem.tolerance.floor),
                    max_abs=tol_req.get("max_abs", problem.tolerance.max_abs))
    kernel_only = req.get("policy", "kernel-only") == "kernel-only"
    cand_path = Path(req["candidate"]).resolve()
    info = devinfo.describe(dev)
    common = dict(problem=problem.name, baseline=problem.baseline_name,
                  candidate=cand_path.name, device=info["name"], timing_device=dev, versions=devinfo.versions(),
                  device_info={k: v for k, v in info.items() if k != "name"})

    def fail(verdict: Verdict, reason: str, **kw: Any) -> EvalResult:
        return EvalResult.failure(verdict, reason, duration_s=_now() - t_start, **common, **kw)

    # 1. Static policy scan: no candidate code runs for a library-attention source.
    source = cand_path.read_text(errors="replace")
    if kernel_only:
        uses = guards.scan_source(source)
        if uses:
            return fail(Verdict.POLICY, "library attention under the kernel-only policy: "
                        + "; ".join(uses) + " (set evaluator.policy: allow-library to permit)")

    # 2. Build (CUDA) before any sandboxing: nvcc is ours, not the candidate's.
    stage("build")
    try:
        loader = build_candidate(cand_path, problem, Path(req["cache_dir"]),
                                 float(req.get("build_timeout_s", 300)), req.get("arch"))
    except LoadFailure as e:
        verdict = Verdict.BUILD_ERROR if e.kind == "build" else Verdict.LOAD_ERROR
        return fail(verdict, e.reason, build_log=e.log)

    # 3. References and tolerance probes, before the candidate exists in this process.
    stage("reference")
    rng = random.Random(int(req["secret_seed"]))
    trials = int(req.get("trials", 3))
    device = torch.device(dev)
    cases = [_prepare_config(problem, cfg, dtype, device, rng, trials)
             for cfg in configs + domain]
    stage("ceiling")
    ceiling = devinfo.measured_matmul_tflops(dtype) if on_gpu and dtype != torch.float32 else None
    if ceiling:
        common["device_info"]["measured_matmul_tflops"] = round(ceiling, 1)
    # Binds the clocks before any candidate code. Before the poisoning: setting up the GPU spin
    # captures a CUDA graph, and torch empties the allocator cache when a capture begins.
    timer = GpuTimer() if on_gpu else CpuTimer()
    if on_gpu:
        devinfo.poison_allocator([c["out_bytes"] for c in cases])

    # 4. Guards, then import.
    violations = guards.Violations()
    lib_guard = guards.install_library_guard(violations) if kernel_only else None
    import evaluator.checks as m1, evaluator.timing as m2, evaluator.harness as m3  # noqa: E401
    from .problems import base as p_base, common as p_common
    spin_mod = []
    if on_gpu:
        import evaluator.spin as m4
        spin_mod.append(m4)
    # Held in this frame only: a candidate that replaces guards' functions cannot blind it.
    tampered = guards.harness_snapshot([m1, m2, m3, guards, p_base, p_common, *spin_mod,
                                        sys.modules[type(problem).__module__]])
    guards.install_sandbox(violations, req.get("allowed_dirs", []))
    stage("load")
    try:
        loaded = loader()
    except LoadFailure as e:
        return fail(Verdict.LOAD_ERROR, e.reason, build_log=e.log)
    common.update(build_log=loaded.build_log, build_cached=loaded.build_cached,
                  build_seconds=loaded.build_seconds)

    def integrity() -> tuple[Verdict, str] | None:
        changed = tampered()
        if changed:
            return Verdict.TAMPERING, "replaced harness functions: " + ", ".join(changed[:5])
        return violations.first()

    def run(inputs: dict[str, Any], cfg: dict[str, Any]) -> Any:
        if lib_guard:
            lib_guard.arm()
        try:
            return loaded.run(inputs, cfg)
        finally:
            if lib_guard:
                lib_guard.disarm()

    bad = integrity()
    if bad:
        return fail(*bad)

    # 5. Correctness on every config and the extra domain shapes; with `screen` (the
    # default) stop at the first failure, else check them all to report every failing one.
    stage("check")
    screen = bool(req.get("screen", True))
    results: dict[int, ConfigResult] = {}
    failed: tuple[Verdict, str] | None = None
    for i, case in enumerate(cases):
        if failed and screen:
            break                              # the rest are marked skipped below
        cfg = case["cfg"]
        try:
            err, bound = _check_case(problem, case, run, tol, on_gpu, cand_path, kernel_only,
                                     violations, integrity)
            results[i] = ConfigResult(cfg, dtype_name, Verdict.PASS, "", err, bound)
        except _Fail as f:
            label = problem.label(cfg) + (" [domain shape]" if i >= len(configs) else "")
            failed = failed or (f.verdict, f"{label}: {f.reason}")
            results[i] = ConfigResult(cfg, dtype_name, f.verdict, f.reason, f.err, case["bound"])
            if f.verdict in (Verdict.CRASH, Verdict.OOM):
                break                          # the CUDA context may be unusable now
    if failed:
        for i in range(len(cases)):
            results.setdefault(i, ConfigResult(cases[i]["cfg"], dtype_name, Verdict.SKIPPED,
                                               "an earlier check failed"))
        return fail(*failed, configs=tuple(results[i] for i in range(len(configs))))

    if on_gpu and kernel_only:
        stage("profile")
        try:
            lib_kernels = _library_kernels(lambda: run(cases[0]["trials"][0]["inputs"],
                                                       cases[0]["cfg"]))
        except BaseException as e:  # noqa: BLE001 - the candidate's failure is data
            return fail(*(violations.first() or (Verdict.CRASH, "raised under the profiler: "
                                                 f"{type(e).__name__}: {e}"[:300])))
        if lib_kernels:
            return fail(Verdict.POLICY, "launched library attention kernels: "
                        + ", ".join(sorted(lib_kernels)[:3]))

    if req.get("check_only"):
        return EvalResult(Verdict.PASS, "correct (not timed)", 0.0,
                          tuple(results[i] for i in range(len(configs))),
                          duration_s=_now() - t_start, **common)

    # 6. Timing, interleaved with the baseline; timed outputs re-checked.
    stage("time")
    out_results: list[ConfigResult] = []
    flags: list[str] = []
    for i, case in enumerate(cases[:len(configs)]):
        try:
            cr = _time_case(problem, case, run, timer, req, rng, info, dtype_name, tol, ceiling,
                            on_gpu, results[i], flags)
        except _Fail as f:
            return fail(f.verdict, f"{problem.label(case['cfg'])}: {f.reason}",
                        configs=tuple(out_results), flags=tuple(flags))
        except BaseException as e:  # noqa: BLE001 - SystemExit from a candidate too
            label, done = problem.label(case["cfg"]), tuple(out_results)
            bad = integrity()        # a tripwire or sandbox refusal is the cause, not a crash
            if bad:
                return fail(*bad, configs=done, flags=tuple(flags))
            if isinstance(e, LazyOutput):
                return fail(Verdict.HIDDEN_WORK, f"{label}: {e}", configs=done, flags=tuple(flags))
            first = str(e).splitlines()[0] if str(e) else ""
            if isinstance(e, torch.OutOfMemoryError):
                return fail(Verdict.OOM, f"{label}: out of memory while timing: {first}",
                            configs=done)
            return fail(Verdict.CRASH, f"{label}: raised while timing: "
                        f"{type(e).__name__}: {first[:300]}", configs=done)
        out_results.append(cr)
        bad = integrity()
        if bad:
            return fail(*bad, configs=tuple(out_results), flags=tuple(flags))
    fitness = geometric_mean([c.speedup or 0.0 for c in out_results])
    return EvalResult(Verdict.PASS, "all configs correct", fitness, tuple(out_results),
                      flags=tuple(flags), duration_s=_now() - t_start, **common)


def _prepare_config(problem: Problem, cfg: dict[str, Any], dtype: Any, device: Any,
                    rng: random.Random, trials: int) -> dict[str, Any]:
    import torch
    gen = torch.Generator(device=device)
    case: dict[str, Any] = {"cfg": cfg, "trials": [], "gen": gen}
    worst_torch_err = 0.0
    for _ in range(trials):
        gen.manual_seed(rng.getrandbits(62))
        inputs = problem.make_inputs(cfg, dtype, device, gen)
        ref = problem.reference(inputs, cfg)
        probe = problem.torch_in_dtype(inputs, cfg)
        worst_torch_err = max(worst_torch_err, checks.max_abs_err(probe, ref))
        case["trials"].append({"inputs": inputs, "ref": ref})
        case["out_bytes"] = probe.numel() * probe.element_size()
        case["like"] = torch.empty_like(probe, device="meta")
        del probe
    case["torch_err"] = worst_torch_err
    return case


def _check_case(problem: Problem, case: dict[str, Any], run: Callable[..., Any], tol: Tolerance,
                on_gpu: bool, cand_path: Path, kernel_only: bool,
                violations: guards.Violations,
                integrity: Callable[[], tuple[Verdict, str] | None]) -> tuple[float, float]:
    """Checks one config over its trials; returns (worst error, bound) or raises _Fail."""
    import torch
    cfg = case["cfg"]
    bound = tol.bound(case["torch_err"])
    case["bound"] = bound
    worst = 0.0
    threads_before: int | None = None    # counted after the first trial: libraries (cuBLAS,
    for t, trial in enumerate(case["trials"]):  # torch) start their worker threads on first use
        inputs = trial["inputs"]
        tensors = problem.input_tensors(inputs)
        before = [x.data_ptr() for x in tensors]
        clones = [x.clone() for x in tensors]
        out = _call(run, inputs, cfg, watch=kernel_only and t == 0, violations=violations)
        if on_gpu:
            torch.cuda.current_stream().synchronize()
        early = out.clone() if type(out) is torch.Tensor else None
        if on_gpu:
            torch.cuda.synchronize()
        time.sleep(0.002)
        sneaky = guards.candidate_threads(str(cand_path))
        if sneaky:
            raise _Fail(Verdict.HIDDEN_WORK, f"candidate threads still running after return: "
                        f"{', '.join(sneaky)}")
        bad = integrity()
        if bad:
            raise _Fail(*bad)
        why = checks.output_problem(out, _Meta(case["like"].shape, case["like"].dtype,
                                               trial["ref"].device))
        if isinstance(out, torch.Tensor) and type(out) is not torch.Tensor:  # may defer work
            raise _Fail(Verdict.HIDDEN_WORK, f"lazy output: {why}")
        if why:
            raise _Fail(Verdict.INCORRECT, why)
        if on_gpu:
            torch.cuda.synchronize()
        if early is not None and not torch.equal(early.nan_to_num(0.125), out.nan_to_num(0.125)):
            raise _Fail(Verdict.HIDDEN_WORK, "output changed after the call returned "
                        "(work on a side stream or thread escaped the caller's stream)")
        changed = checks.inputs_changed(before, tensors, clones)
        if changed:
            raise _Fail(Verdict.TAMPERING, changed)
        err = checks.max_abs_err(out, trial["ref"])
        worst = max(worst, err)
        if err != err or err == float("inf"):
            raise _Fail(Verdict.INCORRECT, "output contains NaN or Inf", err)
        if err > bound:
            raise _Fail(Verdict.INCORRECT, f"max abs error {err:.3g} > tolerance {bound:.3g} "
                        f"(trial {t + 1})", err)
        if t == 0:                              # class 10: same inputs, same answer
            again = _call(run, inputs, cfg, watch=False, violations=violations)
            if on_gpu:
                torch.cuda.synchronize()
            if type(again) is torch.Tensor and again.shape == out.shape:
                diff = checks.max_abs_err(again, out.float())
                if diff > bound:
                    raise _Fail(Verdict.NONDETERMINISTIC, f"two runs on the same inputs differ "
                                f"by {diff:.3g} > tolerance {bound:.3g}")
            del again
        del out, early, clones
        if threads_before is None:
            threads_before = guards.native_thread_count()
    if threads_before is not None and guards.native_thread_count() > threads_before + 8:
        raise _Fail(Verdict.HIDDEN_WORK, "candidate left new OS threads running")
    return worst, bound


class _Meta:
    """Shape/dtype/device triple standing in for a big tensor in output checks."""

    def __init__(self, shape: Any, dtype: Any, device: Any) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device


def _call(run: Callable[..., Any], inputs: dict[str, Any], cfg: dict[str, Any], watch: bool,
          violations: guards.Violations) -> Any:
    """Calls the candidate once; converts its exceptions into _Fail verdicts."""
    import torch
    try:
        if watch:
            with guards.DispatchWatch(violations):
                return run(inputs, cfg)
        return run(inputs, cfg)
    except torch.OutOfMemoryError as e:
        raise _Fail(Verdict.OOM, f"out of memory: {str(e).splitlines()[0][:200]}") from None
    except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from a candidate too
        first = violations.first()
        if first:
            raise _Fail(*first) from None
        msg = str(e).splitlines()[0][:300] if str(e) else ""
        if "illegal memory access" in msg or "misaligned address" in msg:
            raise _Fail(Verdict.CRASH, f"CUDA error: {msg}") from None
        raise _Fail(Verdict.CRASH, f"raised {type(e).__name__}: {msg}") from None


def _library_kernels(call: Callable[[], Any]) -> set[str]:
    """Returns names of library attention kernels launched by one profiled call."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return {n for n in names if guards.LIBRARY_KERNEL_RE.search(n)}


def _time_case(problem: Problem, case: dict[str, Any], run: Callable[..., Any], timer: Any,
               req: dict[str, Any], rng: random.Random, info: dict[str, Any], dtype_name: str,
               tol: Tolerance, ceiling: float | None, on_gpu: bool, checked: ConfigResult,
               flags: list[str]) -> ConfigResult:
    """Times one config against the baseline; re-checks timed outputs; flags implausible speed."""
    cfg = case["cfg"]
    inputs = case["trials"][0]["inputs"]
    gen = case["gen"]
    gen.manual_seed(rng.getrandbits(62))
    reps = int(req.get("reps", 50 if on_gpu else 3))
    warmup = int(req.get("warmup", 10 if on_gpu else 1))
    keep = set(rng.sample(range(reps), k=min(2, reps)))
    fns = {"candidate": lambda inp: run(inp, cfg), "baseline": lambda inp: problem.baseline(inp, cfg)}
    if req.get("all_backends"):
        for name, fn in problem.extra_baselines().items():
            fns[name] = (lambda f: (lambda inp: f(inp, cfg)))(fn)
        # Drop only the PyTorch backends that do not support this config.
        fns = {n: f for n, f in fns.items() if n in ("candidate", "baseline") or _works(f, inputs)}
    timing = timer.run(fns, inputs, lambda inp: problem.refill(inp, gen), warmup, reps,
                       keep, "candidate")
    for rep, out, snap in timing.kept_outputs:       # class 1: stale / cached output
        ref = problem.reference(snap, cfg)
        bound = _fresh_bound(problem, case, snap, ref, tol)
        why = checks.output_problem(out, _Meta(ref.shape, case["like"].dtype, ref.device))
        if why:                                      # an empty tensor's error would read 0
            raise _Fail(Verdict.INCORRECT, f"timed call {rep} returned a bad output: {why}")
        err = checks.max_abs_err(out, ref)
        if not err <= bound:
            raise _Fail(Verdict.INCORRECT, f"timed call {rep} returned a wrong output "
                        f"(error {err:.3g} > {bound:.3g}): stale or cached result?")
    ms, base_ms = timing.ms["candidate"], timing.ms["baseline"]
    host_ms = timing.host_ms_per_call["candidate"]
    launch_ms = timing.launch_ms.get("candidate", 0.0)
    if on_gpu and hidden_work(ms, host_ms, launch_ms):
        raise _Fail(Verdict.HIDDEN_WORK, f"events timed {ms:.4f} ms and calls return in "
                    f"{launch_ms:.4f} ms, but the host saw {host_ms:.4f} ms per call: "
                    "work escaped the timer")
    flops = problem.flops(cfg)
    tflops = flops / (ms * 1e-3) / 1e12 if ms > 0 else float("inf")
    speedup = base_ms / ms if ms > 0 else float("inf")
    peak = devinfo.peak_for(info, dtype_name)
    if (ceiling and tflops > 1.05 * ceiling) or speedup > problem.implausible_speedup:
        flags.append(f"{problem.label(cfg)}: implausible {speedup:.1f}x / {tflops:.0f} TFLOP/s, "
                     "re-verified")
        _reverify(problem, case, run, rng, tol)
        if ceiling and tflops > 1.05 * ceiling:
            raise _Fail(Verdict.IMPLAUSIBLE, f"{tflops:.0f} TFLOP/s exceeds the measured ceiling "
                        f"{ceiling:.0f} TFLOP/s")
    extras = {n: v for n, v in timing.ms.items() if n not in ("candidate", "baseline")}
    return ConfigResult(
        cfg, dtype_name, Verdict.PASS, "", checked.max_abs_err, checked.tolerance, ms, base_ms,
        tflops, flops / (base_ms * 1e-3) / 1e12 if base_ms > 0 else None, speedup,
        tflops / peak if peak else None, timing.peak_mem_bytes["candidate"],
        timing.peak_mem_bytes["baseline"], extras)


def _fresh_bound(problem: Problem, case: dict[str, Any], inputs: dict[str, Any], ref: Any,
                 tol: Tolerance) -> float:
    """Returns the tolerance on new inputs: torch's own error on them counts too."""
    probe = problem.torch_in_dtype(inputs, case["cfg"])
    return tol.bound(max(case["torch_err"], checks.max_abs_err(probe, ref)))


def _reverify(problem: Problem, case: dict[str, Any], run: Callable[..., Any],
              rng: random.Random, tol: Tolerance) -> None:
    """Re-checks an implausibly fast candidate on fresh inputs; raises _Fail if wrong."""
    cfg = case["cfg"]
    gen = case["gen"]
    for _ in range(2):
        gen.manual_seed(rng.getrandbits(62))
        inputs = case["trials"][0]["inputs"]
        problem.refill(inputs, gen)
        ref = problem.reference(inputs, cfg)
        bound = _fresh_bound(problem, case, inputs, ref, tol)
        out = run(inputs, cfg)
        why = checks.output_problem(out, _Meta(ref.shape, case["like"].dtype, ref.device))
        err = float("inf") if why else checks.max_abs_err(out, ref)
        if not err <= bound:
            raise _Fail(Verdict.IMPLAUSIBLE, f"implausibly fast and wrong on fresh inputs "
                        f"(error {err:.3g})")


def _works(fn: Callable[[Any], Any], inputs: dict[str, Any]) -> bool:
    try:
        fn(inputs)
        return True
    except Exception:  # noqa: BLE001 - a backend that does not support this config
        return False

