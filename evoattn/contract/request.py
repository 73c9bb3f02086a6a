"""The one request that crosses into the evaluator's child, and every evaluation default.

`EvalRequest` is built in one place on the orchestrator's side (evoattn/settings.py, from a
run config or `evoattn eval`'s flags), completed per candidate by the sandbox (candidate
path, cache, secret seed), sent to the child as JSON and read there by field. Defaults live
here and nowhere else: the run config's `evaluator:` section and the CLI flags default to
"not set", which means the value below.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .names import DTYPES, TIMING_MODES, WIDTH

POLICIES = ("kernel-only", "allow-library")
GPU_REPS, GPU_WARMUP = 30, 10      # the most rounds of the fitness mode (evoattn/child/timing.py)
                                   # and untimed calls per config, on a GPU
CPU_REPS, CPU_WARMUP = 4, 1        # on the CPU (Triton's interpreter is slow): at most these


@dataclasses.dataclass(frozen=True)
class EvalRequest:
    """How to evaluate one candidate. Times in seconds; None means the documented default."""

    problem: str = "sdpa"                      # a built-in name or an absolute problem .py path
    device: str = "cuda"                       # "cuda" or "cpu"
    configs: tuple[dict[str, Any], ...] | None = None   # None: the problem's (CPU) configs
    # Checked in each (a candidate wrong in any one is incorrect); timed in the first. None:
    # the problem's default dtype alone.
    dtypes: tuple[str, ...] | None = None
    # checking
    trials: int = 3                            # fresh random inputs per config
    tolerance_factor: float | None = None      # None: the problem's own tolerance
    tolerance_floor: float | None = None
    max_abs: float | None = None
    policy: str = "kernel-only"
    screen: bool = True                        # stop at the first failing config
    check_only: bool = False                   # check, do not time
    # timing
    timing: str = "call"                       # which time fitness uses: call | kernel | graph
    baseline: str = "best"                     # the fastest baseline per config, or one by name
    all_backends: bool = False                 # also time the problem's diagnostic backends
    warmup: int | None = None                  # None: GPU_WARMUP / CPU_WARMUP
    reps: int | None = None                    # None: GPU_REPS / CPU_REPS (CPU_REPS at most)
    # The fitness mode's rounds stop once each config's speedup is known within this relative
    # half-width (95%), or at `reps`. A run's plain candidates take its
    # `evaluator.candidate_width`; duels and `evoattn eval` keep this.
    width: float = WIDTH
    graph: bool = True                         # also time graph mode (always when it is `timing`)
    # call mode's heat before heavy batches (evoattn/child/timing.py: heavy calls timed at the
    # clocks of a sustained loop); a run's plain candidates take `evaluator.candidate_heat`
    heat: bool = True
    # limits
    build_timeout_s: float = 300.0
    run_timeout_s: float = 600.0               # a ceiling; runs derive a tighter one (sandbox)
    # set per candidate by the sandbox
    candidate: str = ""                        # the main file's path in the child's directory
    cache_dir: str = ""
    allowed_dirs: tuple[str, ...] = ()
    secret_seed: int = 0
    arch: str | None = None                    # nvcc target; None: the GPU's own
    facts: dict[str, str] = dataclasses.field(default_factory=dict)   # {"target": "sm90"}
    # a duel: a second program (its main file, in its own directory) checked and timed beside
    # the candidate in the same interleaved rounds; the result carries its times and the gain
    rival: str = ""
    # given by a run's station (evoattn/station.py): then the child times no baseline itself
    baseline_times: dict[str, dict[str, dict[str, Any]]] | None = None
    ceiling_tflops: float | None = None
    # When evaluations share one GPU: the lock file of their turns on it (evoattn/child/gpu_turn.py:
    # checks and timing take turns, builds and the baselines' set-up overlap them).
    gpu_lock: str = ""
    # On a GPU the timing thread runs on the fastest of these CPUs (evoattn/child/cpu_pin.py; empty:
    # any the child may use): a run gives the slots of each GPU their own block.
    pin_cpu: bool = True
    timing_cpus: tuple[int, ...] = ()

    def validate(self) -> None:
        """Raises ValueError naming the field when a value is out of range."""
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.timing not in TIMING_MODES:
            raise ValueError(f"timing must be one of {', '.join(TIMING_MODES)}, got "
                             f"{self.timing!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.dtypes is not None:
            if not self.dtypes:
                raise ValueError("dtypes must name at least one dtype (or be None: the "
                                 "problem's default)")
            for d in self.dtypes:
                if d not in DTYPES:
                    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {d!r}")
            if len(set(self.dtypes)) != len(self.dtypes):
                raise ValueError(f"dtypes name one dtype twice: {', '.join(self.dtypes)}")
        for name in ("trials", "warmup", "reps"):
            value = getattr(self, name)
            if value is not None and value < (1 if name == "trials" else 0):
                raise ValueError(f"{name} must be >= {1 if name == 'trials' else 0}, got {value}")
        if not 0 < self.width < 1:
            raise ValueError(f"width must be between 0 and 1, got {self.width}")
        for name in ("build_timeout_s", "run_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    def same_set_up(self, other: "EvalRequest") -> bool:
        """Returns True if an evaluation set up for this request (preparation.prepare: inputs,
        references, the baselines' plans, made before a run's spare child knows its candidate)
        serves `other`: they agree on every field that set-up reads."""
        return all(getattr(self, f) == getattr(other, f) for f in _SET_UP_FIELDS) and \
            (self.baseline_times is None) == (other.baseline_times is None)

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def dtype(self) -> str | None:
        """Returns the dtype timing uses (the first of `dtypes`; None: the problem's default)."""
        return self.dtypes[0] if self.dtypes else None

    def resolved_dtypes(self, default: str) -> tuple[str, ...]:
        """Returns the dtypes to check, the timed one first, given the problem's default."""
        return self.dtypes or (default,)

    def resolved_reps(self) -> int:
        """Returns the timed repetitions for this device."""
        if self.on_gpu:
            return GPU_REPS if self.reps is None else self.reps
        return CPU_REPS if self.reps is None else min(self.reps, CPU_REPS)

    def resolved_warmup(self) -> int:
        """Returns the untimed calls before timing, for this device."""
        if self.on_gpu:
            return GPU_WARMUP if self.warmup is None else self.warmup
        return CPU_WARMUP if self.warmup is None else min(self.warmup, CPU_WARMUP)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["configs"] = None if self.configs is None else [dict(c) for c in self.configs]
        d["allowed_dirs"] = list(self.allowed_dirs)
        d["dtypes"] = None if self.dtypes is None else list(self.dtypes)
        d["timing_cpus"] = list(self.timing_cpus)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "EvalRequest":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown request field {', '.join(unknown)}")
        kw = dict(d)
        if kw.get("configs") is not None:
            kw["configs"] = tuple(dict(c) for c in kw["configs"])
        kw["allowed_dirs"] = tuple(kw.get("allowed_dirs", ()))
        kw["timing_cpus"] = tuple(int(c) for c in kw.get("timing_cpus", ()))
        if kw.get("dtypes") is not None:
            kw["dtypes"] = tuple(kw["dtypes"])
        return cls(**kw)


DEFAULTS = EvalRequest()
_SET_UP_FIELDS = ("problem", "device", "configs", "dtypes", "trials", "tolerance_factor",
                  "tolerance_floor", "max_abs", "check_only", "cache_dir", "secret_seed",
                  "gpu_lock")
