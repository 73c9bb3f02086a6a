"""The correctness stage: every config and domain shape, each over its trials.

A failing check raises `Fail` with its verdict; `check_all` turns that into per-config
results (the candidate's failure is data, the exception never leaves this module's caller).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

from . import checks, guards
from .cases import Case
from ..contract.types import ConfigResult, Verdict

Integrity = Callable[[], "tuple[Verdict, str] | None"]
Run = Callable[[dict[str, Any], dict[str, Any]], Any]


class Fail(Exception):
    """Ends checking or timing of a config with a verdict (control flow inside the child)."""

    def __init__(self, verdict: Verdict, reason: str, err: float | None = None) -> None:
        super().__init__(reason)
        self.verdict, self.reason, self.err = verdict, reason, err


@dataclasses.dataclass(frozen=True)
class Meta:
    """Shape/dtype/device triple standing in for a big tensor in output checks."""

    shape: Any
    dtype: Any
    device: Any


@dataclasses.dataclass(frozen=True)
class Checked:
    """The check stage's outcome: a result per case, and the first failure if any."""

    results: tuple[ConfigResult, ...]          # one per case, in order (skipped after a failure)
    failed: tuple[Verdict, str] | None


def check_all(cases: list[Case], dtype_name: str, run: Run, on_gpu: bool, root: Path,
              watch: bool, violations: guards.Violations, integrity: Integrity,
              screen: bool) -> Checked:
    """Checks every case; with `screen`, stops at the first failure (the rest are skipped)."""
    results: dict[int, ConfigResult] = {}
    failed: tuple[Verdict, str] | None = None
    for i, case in enumerate(cases):
        if failed and screen:
            break
        try:
            err = check_case(case, run, on_gpu, root, watch, violations, integrity)
            results[i] = ConfigResult(case.cfg, dtype_name, Verdict.PASS, "", err, case.bound)
        except Fail as f:
            failed = failed or (f.verdict, f"{case.label}: {f.reason}")
            results[i] = ConfigResult(case.cfg, dtype_name, f.verdict, f.reason, f.err, case.bound)
            if f.verdict in (Verdict.CRASH, Verdict.OOM):
                break                          # the CUDA context may be unusable now
    if failed:
        for i, case in enumerate(cases):
            results.setdefault(i, ConfigResult(case.cfg, dtype_name, Verdict.SKIPPED,
                                               "an earlier check failed"))
    return Checked(tuple(results[i] for i in range(len(cases))), failed)


def check_case(case: Case, run: Run, on_gpu: bool, root: Path, watch: bool,
               violations: guards.Violations, integrity: Integrity) -> float:
    """Checks one config over its trials; returns the worst error or raises Fail."""
    import torch
    worst = 0.0
    threads_before: int | None = None    # counted after the first trial: libraries (cuBLAS,
    for t, trial in enumerate(case.trials):   # torch) start their worker threads on first use
        inputs = trial.inputs
        tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
        before = [x.data_ptr() for x in tensors]
        clones = [x.clone() for x in tensors]
        out = call(run, inputs, case.cfg, watch=watch and t == 0, violations=violations)
        if on_gpu:
            torch.cuda.current_stream().synchronize()
        early = out.clone() if type(out) is torch.Tensor else None
        if on_gpu:
            torch.cuda.synchronize()
        time.sleep(0.002)
        sneaky = guards.candidate_threads(str(root))
        if sneaky:
            raise Fail(Verdict.HIDDEN_WORK, f"candidate threads still running after return: "
                       f"{', '.join(sneaky)}")
        bad = integrity()
        if bad:
            raise Fail(*bad)
        why = checks.output_problem(out, Meta(case.like.shape, case.like.dtype, trial.ref.device))
        if isinstance(out, torch.Tensor) and type(out) is not torch.Tensor:  # may defer work
            raise Fail(Verdict.HIDDEN_WORK, f"lazy output: {why}")
        if why:
            raise Fail(Verdict.INCORRECT, why)
        if on_gpu:
            torch.cuda.synchronize()
        if early is not None and not torch.equal(early.nan_to_num(0.125), out.nan_to_num(0.125)):
            raise Fail(Verdict.HIDDEN_WORK, "output changed after the call returned "
                       "(work on a side stream or thread escaped the caller's stream)")
        changed = checks.inputs_changed(before, tensors, clones)
        if changed:
            raise Fail(Verdict.TAMPERING, changed)
        err = checks.max_abs_err(out, trial.ref)
        worst = max(worst, err)
        if err != err or err == float("inf"):
            raise Fail(Verdict.INCORRECT, "output contains NaN or Inf", err)
        if err > case.bound:
            raise Fail(Verdict.INCORRECT, f"max abs error {err:.3g} > tolerance {case.bound:.3g} "
                       f"(trial {t + 1})", err)
        if t == 0:                              # class 10: same inputs, same answer
            again = call(run, inputs, case.cfg, watch=False, violations=violations)
            if on_gpu:
                torch.cuda.synchronize()
            if type(again) is torch.Tensor and again.shape == out.shape:
                diff = checks.max_abs_err(again, out.float())
                if diff > case.bound:
                    raise Fail(Verdict.NONDETERMINISTIC, f"two runs on the same inputs differ "
                               f"by {diff:.3g} > tolerance {case.bound:.3g}")
            del again
        del out, early, clones
        if threads_before is None:
            threads_before = guards.native_thread_count()
    if threads_before is not None and guards.native_thread_count() > threads_before + 8:
        raise Fail(Verdict.HIDDEN_WORK, "candidate left new OS threads running")
    return worst


def call(run: Run, inputs: dict[str, Any], cfg: dict[str, Any], watch: bool,
         violations: guards.Violations) -> Any:
    """Calls the candidate once; converts its exceptions into Fail verdicts."""
    import torch
    try:
        if watch:
            with guards.DispatchWatch(violations):
                return run(inputs, cfg)
        return run(inputs, cfg)
    except torch.OutOfMemoryError as e:
        raise Fail(Verdict.OOM, f"out of memory: {str(e).splitlines()[0][:200]}") from None
    except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from a candidate too
        first = violations.first()
        if first:
            raise Fail(*first) from None
        msg = str(e).splitlines()[0][:300] if str(e) else ""
        if "illegal memory access" in msg or "misaligned address" in msg:
            raise Fail(Verdict.CRASH, f"CUDA error: {msg}") from None
        raise Fail(Verdict.CRASH, f"raised {type(e).__name__}: {msg}") from None


def library_kernels(call_once: Callable[[], Any]) -> set[str]:
    """Returns names of library attention kernels launched by one profiled call."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call_once()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return {n for n in names if guards.LIBRARY_KERNEL_RE.search(n)}
