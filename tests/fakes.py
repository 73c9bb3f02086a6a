"""Fakes behind the narrow interfaces: an evaluator that scores knob settings without a GPU."""
from __future__ import annotations

import dataclasses

from evaluator.types import ConfigResult, EvalResult, Times, Verdict
from evoattn.mutators.knobs import find_knobs
from evoattn.sandbox import SandboxSettings, SubprocessEvaluator


@dataclasses.dataclass
class FakeEvaluator:
    """Scores a program from its knob values: deterministic, instant, records every call."""

    fail_when: dict[str, str] = dataclasses.field(default_factory=dict)  # knob=value -> fails
    calls: list[str] = dataclasses.field(default_factory=list)

    closed: bool = False

    def close(self) -> None:
        self.closed = True

    duels: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (source, rival)

    def score(self, source: str) -> float:
        """The program's true speed over the baseline, from its knob values."""
        knobs = {k.name: k.value for k in find_knobs(source)}
        score = 1.0
        for i, (name, value) in enumerate(sorted(knobs.items())):
            try:
                score += (i + 1) * 0.01 * float(value == "True" or value.isdigit() and int(value))
            except ValueError:
                pass
        return score

    def evaluate(self, source: str, suffix: str, label: str = "",
                 rival: str | None = None) -> EvalResult:
        if rival is None:                   # a duel is a re-measurement, listed in `duels`
            self.calls.append(source)
        knobs = {k.name: k.value for k in find_knobs(source)}
        for name, value in self.fail_when.items():
            if knobs.get(name) == value:
                return EvalResult.failure(Verdict.INCORRECT, f"{name}={value} is wrong")
        score = self.score(source)
        cfg = ConfigResult({"B": 1, "H": 1, "S": 64, "D": 64, "causal": False}, "float16",
                           Verdict.PASS, "", 0.0, 1e-3, ms=1.0 / score, baseline_ms=1.0,
                           baseline_name="baseline", tflops=score, baseline_tflops=score,
                           speedup=score)
        if rival is None:
            return EvalResult(Verdict.PASS, "ok", score, (cfg,), device="fake")
        self.duels.append((source, rival))
        return duel_result(score, self.score(rival), 0.002)


def duel_result(score: float, rival_score: float, rel_noise: float) -> EvalResult:
    """A duel's result for programs of these true speeds, measured within +-rel_noise."""
    gain = score / rival_score
    ci = (gain * (1 - rel_noise), gain * (1 + rel_noise))
    cfg = ConfigResult({"B": 1, "H": 1, "S": 64, "D": 64, "causal": False}, "float16",
                       Verdict.PASS, "", 0.0, 1e-3, ms=1.0 / score, baseline_ms=1.0,
                       baseline_name="baseline", speedup=score, gain=gain, gain_ci=ci,
                       rival_times=Times(kernel_ms=1.0 / rival_score, call_ms=1.0 / rival_score))
    return EvalResult(Verdict.PASS, "ok", score, (cfg,), device="fake", rival="rival.py",
                      rival_fitness=rival_score, gain=gain, gain_ci=ci,
                      fitness_ci=(score * (1 - rel_noise), score * (1 + rel_noise)))


TOY_SEED = """\
import torch
BLOCK_M = 64  # evoattn: choice(16, 32, 64, 128)
BLOCK_N = 32  # evoattn: choice(16, 32, 64)
STAGES = 2  # evoattn: choice(1, 2, 3, 4)
SPLIT = False  # evoattn: choice(True, False)
def attention(q, k, v, causal=False, scale=None):
    return q
"""


def sandboxed(*, cache_dir: str = "", zygote: bool | None = None,
              max_host_mem_bytes: int | None = None, spare: bool = False,
              **request: object) -> SubprocessEvaluator:
    """Returns a real sandboxed evaluator: request fields and sandbox settings by keyword."""
    from evaluator.request import EvalRequest
    sandbox: dict[str, object] = {"cache_dir": cache_dir, "spare": spare}
    if zygote is not None:
        sandbox["zygote"] = zygote
    if max_host_mem_bytes is not None:
        sandbox["max_host_mem_bytes"] = max_host_mem_bytes
    if request.get("configs") is not None:
        request["configs"] = tuple(request["configs"])  # type: ignore[arg-type]
    return SubprocessEvaluator(EvalRequest(**request), SandboxSettings(**sandbox))  # type: ignore
