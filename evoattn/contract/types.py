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
    EVALUATOR_FAULT = "evaluator_fault"  # the evaluator's process died: no verdict on the kernel
    COMPILED = "compiled"              # a CUDA file built, with no GPU here to run it

    @property
    def is_pass(self) -> bool:
        return self is Verdict.PASS


# Exit codes of `evoattn eval`, documented in the README.
EXIT_OK = 0
EXIT_INCORRECT = 1      # incorrect, or any integrity verdict
EXIT_BUILD = 2          # build_error / load_error
EXIT_CRASH = 3          # timeout / crash / oom
EXIT_USAGE = 4          # bad usage: missing file, unknown problem, malformed YAML
EXIT_FAULT = 5          # the evaluator itself failed twice: no verdict on the kernel
EXIT_COMPILED = 6       # compile-only: a CUDA file built, but there is no GPU to run it
EXIT_INTERRUPTED = 130  # Ctrl-C, after a clean stop (other signals: 128 + the signal)

# Exit codes of the evaluator's own processes, which the parent reads (evoattn/sandbox.py).
CHILD_NO_RESULT = 70    # a child ended without a result: its parent was gone or its start failed
SPARE_UNPREPARED = 75   # a spare's set-up failed before it was told its candidate


def exit_code_for(verdict: Verdict) -> int:
    """Returns the CLI exit code for an overall verdict."""
    if verdict is Verdict.PASS:
        return EXIT_OK
    if verdict in (Verdict.BUILD_ERROR, Verdict.LOAD_ERROR):
        return EXIT_BUILD
    if verdict in (Verdict.TIMEOUT, Verdict.CRASH, Verdict.OOM):
        return EXIT_CRASH
    if verdict is Verdict.EVALUATOR_FAULT:
        return EXIT_FAULT
    if verdict is Verdict.COMPILED:
        return EXIT_COMPILED
    return EXIT_INCORRECT


HOST_BOUND = 0.8      # call mode issued a function's calls in this share of their time per call
                      # or more: the host set its call time (Times.host_bound)


@dataclasses.dataclass(frozen=True)
class Times:
    """One function's times on one config in every timing mode (evoattn/child/timing.py).

    kernel_ms  the call alone on the GPU: L2 flushed, inputs refilled, host launch hidden
    call_ms    steady state of back-to-back eager calls on distinct inputs, host cost included
    graph_ms   the same calls replayed from a CUDA graph (None, with graph_error, when the
               call cannot be captured, and always on the CPU)
    host_us    CPU time of one call while the GPU is busy
    issue_us   call mode's host time per call to issue its calls (near call_ms: host-bound)
    """

    kernel_ms: float | None = None
    call_ms: float | None = None
    graph_ms: float | None = None
    graph_error: str = ""
    host_us: float | None = None
    issue_us: float | None = None
    # 95% intervals of the medians above (evoattn/contract/stats.py), and the rounds behind them
    kernel_ci: tuple[float, float] | None = None
    call_ci: tuple[float, float] | None = None
    graph_ci: tuple[float, float] | None = None
    rounds: dict[str, int] = dataclasses.field(default_factory=dict)   # mode -> rounds

    def in_mode(self, mode: str) -> float | None:
        """Returns the time (ms) in one timing mode."""
        return {"kernel": self.kernel_ms, "call": self.call_ms, "graph": self.graph_ms}[mode]

    def host_bound(self) -> bool:
        """Whether call mode issued the calls at about their rate (HOST_BOUND or more of
        their time per call): the host's speed, not the GPU, set the call time."""
        return self.issue_us is not None and bool(self.call_ms) and \
            self.issue_us * 1e-3 >= HOST_BOUND * (self.call_ms or 0.0)

    def ci_in_mode(self, mode: str) -> tuple[float, float] | None:
        """Returns the 95% interval (ms) of the time in one timing mode."""
        return {"kernel": self.kernel_ci, "call": self.call_ci, "graph": self.graph_ci}[mode]

    def to_json(self) -> dict[str, Any]:
        return _clean(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Times":
        return _from_json(cls, d)


@dataclasses.dataclass(frozen=True)
class ConfigResult:
    """One benchmark config of one candidate. Times in milliseconds, memory in bytes.

    `ms`, `baseline_ms`, `speedup` and the TFLOP/s are in the result's timing mode; `times`
    and `baseline_times` hold every mode.
    """

    params: dict[str, Any]             # e.g. {"B": 2, "H": 32, "S": 2048, "D": 64, "causal": True}
    dtype: str
    verdict: Verdict
    reason: str = ""
    max_abs_err: float | None = None
    tolerance: float | None = None
    ms: float | None = None            # candidate median in the timing mode
    baseline_ms: float | None = None   # the fitness baseline's, in the timing mode
    baseline_name: str = ""            # which baseline that is (the fastest, by default)
    tflops: float | None = None
    baseline_tflops: float | None = None
    speedup: float | None = None       # baseline / candidate: the median of the units' ratios
                                       # (baseline_ms / ms where timed apart)
    speedup_ci: tuple[float, float] | None = None   # its 95% interval
    frac_peak: float | None = None     # tflops / the GPU's peak
    peak_mem_bytes: int | None = None  # candidate's peak beyond inputs and output
    baseline_peak_mem_bytes: int | None = None
    times: Times | None = None         # the candidate in every mode
    baselines: dict[str, float] = dataclasses.field(default_factory=dict)  # name -> ms (mode)
    baseline_times: dict[str, Times] = dataclasses.field(default_factory=dict)
    backends_ms: dict[str, float] = dataclasses.field(default_factory=dict)  # --all-backends
    # A duel (the candidate re-measured beside a rival program in the same rounds): the
    # rival's times, and rival ms / candidate ms in the timing mode with its interval.
    rival_times: Times | None = None
    gain: float | None = None
    gain_ci: tuple[float, float] | None = None
    timing_s: float | None = None      # wall seconds its timing took (every mode, every function)

    def to_json(self) -> dict[str, Any]:
        d = _clean(dataclasses.asdict(self))
        t = self.times or Times()
        d.update(kernel_ms=t.kernel_ms, call_ms=t.call_ms, graph_ms=t.graph_ms,
                 graph_error=t.graph_error, host_us=t.host_us)   # flat, as documented
        d.update(self.params)          # flat B, H, S, D, causal keys as documented
        return _clean(d)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ConfigResult":
        return _from_json(cls, d)


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """The verdict on one candidate over all selected configs."""

    verdict: Verdict
    reason: str
    fitness: float                     # geometric-mean speedup; 0 unless correct
    configs: tuple[ConfigResult, ...] = ()
    fitness_ci: tuple[float, float] | None = None   # its 95% interval
    problem: str = "sdpa"
    dtypes: tuple[str, ...] = ()       # checked in each (a pass is correct in every one); the
                                       # configs' times are in the first
    timing: str = "call"               # the timing mode of ms, speedup and fitness
    baseline: str = "best"             # the fitness baseline: "best" (fastest per config) or a name
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
    # A duel: the rival's fitness against the same baselines in the same rounds, and the
    # geometric mean of the per-config gains (rival ms / candidate ms) with its interval.
    rival: str = ""
    rival_fitness: float | None = None
    rival_fitness_ci: tuple[float, float] | None = None
    gain: float | None = None
    gain_ci: tuple[float, float] | None = None

    @property
    def correct(self) -> bool:
        return self.verdict is Verdict.PASS

    def to_json(self) -> dict[str, Any]:
        d = _clean(dataclasses.asdict(self))
        d["correct"] = self.correct
        d["configs"] = [c.to_json() for c in self.configs]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "EvalResult":
        return _from_json(cls, d)

    @classmethod
    def failure(cls, verdict: Verdict, reason: str, **kw: Any) -> "EvalResult":
        """Returns a non-passing result with fitness 0."""
        return cls(verdict=verdict, reason=reason, fitness=0.0, **kw)


def _from_json(cls: type, d: dict[str, Any]) -> Any:
    """Builds a result dataclass from its JSON, field by field (unknown keys are ignored)."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        value = d[f.name]
        if f.name == "verdict":
            value = Verdict(value)
        elif f.name == "configs":
            value = tuple(ConfigResult.from_json(c) for c in value)
        elif f.name in ("times", "rival_times"):
            value = None if value is None else Times.from_json(value)
        elif f.name.endswith("_ci"):
            value = None if value is None else (float(value[0]), float(value[1]))
        elif f.name == "baseline_times":
            value = {k: Times.from_json(v) for k, v in (value or {}).items()}
        elif f.name in ("flags", "dtypes"):
            value = tuple(value)
        elif isinstance(value, str) and value in ("nan", "inf", "-inf") and f.name != "reason":
            value = float(value)           # _clean wrote non-finite floats as strings
        kw[f.name] = value
    return cls(**kw)


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
