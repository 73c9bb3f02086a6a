"""Data that crosses the parent/child boundary: verdicts and results.

Everything here is a frozen dataclass that round-trips through JSON, so the
child can send it over a pipe and the parent can store it in SQLite.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any


class Verdict(str, enum.Enum):
    """Outcome of evaluating a candidate (or one config of it)."""

    PASS = "pass"
    INCORRECT = "incorrect"            # wrong values, NaN/Inf, wrong shape/dtype/type
    BUILD_ERROR = "build_error"        # nvcc / cpp_extension failed
    LOAD_ERROR = "load_error"          # syntax error, raises at import, no entry point
    TIMEOUT = "timeout"                # build or run past its limit
    CRASH = "crash"                    # segfault, illegal memory access, exception in a call
    OOM = "oom"                        # GPU (or host) out of memory
    POLICY = "policy_violation"        # library attention under the kernel-only policy
    TAMPERING = "tampering"            # modified inputs or the harness itself
    HIDDEN_WORK = "hidden_work"        # work escaping the timer: side streams, threads, lazy outputs
    NONDETERMINISTIC = "nondeterministic"  # two runs on the same inputs disagree
    IMPLAUSIBLE = "implausible"        # faster than physics allows and failed re-verification
    SANDBOX = "sandbox_violation"      # secrets, writes outside its dir, spawning processes
    SKIPPED = "skipped"                # not run because an earlier check failed

    @property
    def is_pass(self) -> bool:
        return self is Verdict.PASS


# Exit codes of `evoattn eval`, documented in the README.
EXIT_OK = 0
EXIT_INCORRECT = 1      # incorrect, or any integrity verdict
EXIT_BUILD = 2          # build_error / load_error
EXIT_CRASH = 3          # timeout / crash / oom
EXIT_USAGE = 4          # bad usage: missing file, unknown problem, malformed YAML


def exit_code_for(verdict: Verdict) -> int:
    """Returns the CLI exit code for an overall verdict."""
    if verdict is Verdict.PASS:
        return EXIT_OK
    if verdict in (Verdict.BUILD_ERROR, Verdict.LOAD_ERROR):
        return EXIT_BUILD
    if verdict in (Verdict.TIMEOUT, Verdict.CRASH, Verdict.OOM):
        return EXIT_CRASH
    return EXIT_INCORRECT


@dataclasses.dataclass(frozen=True)
class ConfigResult:
    """One benchmark config of one candidate. Times in milliseconds, memory in bytes."""

    params: dict[str, Any]             # e.g. {"B": 2, "H": 32, "S": 2048, "D": 64, "causal": True}
    dtype: str
    verdict: Verdict
    reason: str = ""
    max_abs_err: float | None = None
    tolerance: float | None = None
    ms: float | None = None            # candidate median
    baseline_ms: float | None = None   # problem baseline median, timed interleaved
    tflops: float | None = None
    baseline_tflops: float | None = None
    speedup: float | None = None       # baseline_ms / ms
    frac_peak: float | None = None     # tflops / the GPU's peak
    peak_mem_bytes: int | None = None  # candidate's peak beyond inputs and output
    baseline_peak_mem_bytes: int | None = None
    extra_baselines_ms: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["verdict"] = self.verdict.value
        d.update(self.params)          # flat B, H, S, D, causal keys as documented
        return _clean(d)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ConfigResult":
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["verdict"] = Verdict(d["verdict"])
        return cls(**kw)


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """The verdict on one candidate over all selected configs."""

    verdict: Verdict
    reason: str
    fitness: float                     # geometric-mean speedup; 0 unless correct
    configs: tuple[ConfigResult, ...] = ()
    problem: str = "sdpa"
    baseline: str = "sdpa"             # what speedups are measured against
    candidate: str = ""
    device: str = ""                   # e.g. "NVIDIA H100 80GB HBM3" or "cpu"
    timing_device: str = "cuda"        # "cpu" timings are labelled as such everywhere
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    device_info: dict[str, Any] = dataclasses.field(default_factory=dict)  # SMs, smem, peaks
    flags: tuple[str, ...] = ()        # integrity flags raised (even when re-verified)
    build_log: str = ""
    log_tail: str = ""                 # last lines of the child's stdout/stderr
    build_cached: bool | None = None
    build_seconds: float | None = None
    duration_s: float = 0.0
    stage_s: dict[str, float] = dataclasses.field(default_factory=dict)  # wall time per stage

    @property
    def correct(self) -> bool:
        return self.verdict is Verdict.PASS

    def to_json(self) -> dict[str, Any]:
        return _clean({
            "correct": self.correct,
            "verdict": self.verdict.value,
            "reason": self.reason,
            "fitness": self.fitness,
            "problem": self.problem,
            "baseline": self.baseline,
            "candidate": self.candidate,
            "device": self.device,
            "timing_device": self.timing_device,
            "versions": self.versions,
            "device_info": self.device_info,
            "flags": list(self.flags),
            "build_log": self.build_log,
            "log_tail": self.log_tail,
            "build_cached": self.build_cached,
            "build_seconds": self.build_seconds,
            "duration_s": self.duration_s,
            "stage_s": self.stage_s,
            "configs": [c.to_json() for c in self.configs],
        })

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "EvalResult":
        return cls(
            verdict=Verdict(d["verdict"]),
            reason=d.get("reason", ""),
            fitness=float(d.get("fitness", 0.0)),
            configs=tuple(ConfigResult.from_json(c) for c in d.get("configs", [])),
            problem=d.get("problem", "sdpa"),
            baseline=d.get("baseline", "sdpa"),
            candidate=d.get("candidate", ""),
            device=d.get("device", ""),
            timing_device=d.get("timing_device", "cuda"),
            versions=dict(d.get("versions", {})),
            device_info=dict(d.get("device_info", {})),
            flags=tuple(d.get("flags", ())),
            build_log=d.get("build_log", ""),
            log_tail=d.get("log_tail", ""),
            build_cached=d.get("build_cached"),
            build_seconds=d.get("build_seconds"),
            duration_s=float(d.get("duration_s", 0.0)),
            stage_s={str(k): float(v) for k, v in (d.get("stage_s") or {}).items()},
        )

    @classmethod
    def failure(cls, verdict: Verdict, reason: str, **kw: Any) -> "EvalResult":
        """Returns a non-passing result with fitness 0."""
        return cls(verdict=verdict, reason=reason, fitness=0.0, **kw)


def geometric_mean(values: list[float]) -> float:
    """Returns the geometric mean of positive values (0.0 for an empty list)."""
    vals = [v for v in values if v and v > 0]
    if not vals or len(vals) != len(values):
        return 0.0
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def _clean(obj: Any) -> Any:
    """Makes floats JSON-safe (NaN/Inf become strings) recursively."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj
