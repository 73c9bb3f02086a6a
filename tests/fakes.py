"""Fakes behind the narrow interfaces: an evaluator that scores knob settings without a GPU."""
from __future__ import annotations

import dataclasses

from evoattn.contract.types import ConfigResult, EvalResult, Times, Verdict
from evoattn.mutators.knobs import find_knobs
from evoattn.sandbox import SandboxSettings, SubprocessEvaluator


class FakeSlot:
    """The lifecycle of an evaluation slot (types.Evaluator) with nothing to start or stop."""

    def calibrate(self, seed: EvalResult) -> None:
        pass

    def prestart(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass
class FakeEvaluator(FakeSlot):
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


def timed(call: float, kernel: float, rel: float) -> Times:
    """Times in call and kernel mode, each known within +-rel."""
    return Times(kernel_ms=kernel, call_ms=call, kernel_ci=(kernel * (1 - rel), kernel * (1 + rel)),
                 call_ci=(call * (1 - rel), call * (1 + rel)))


def duel_with_a_hidden_kernel_loss(kernel_best_ms: float) -> EvalResult:
    """Best vs seed on two configs: one host-bound (call 23 µs each, the best's kernel
    `kernel_best_ms` against the seed's 0.0114), one where the two tie in every mode."""
    small, big = ({"B": 1, "H": 8, "S": 512, "D": 64, "causal": False},
                  {"B": 4, "H": 16, "S": 4096, "D": 128, "causal": False})
    base = {"sdpa": Times(kernel_ms=0.0115, call_ms=0.032)}
    configs = (
        ConfigResult(small, "float16", Verdict.PASS, ms=0.023, baseline_ms=0.032,
                     baseline_name="sdpa", speedup=0.032 / 0.023, speedup_ci=(1.37, 1.41),
                     times=timed(0.023, kernel_best_ms, 0.02),
                     rival_times=timed(0.023, 0.0114, 0.02), baseline_times=base,
                     gain=1.0, gain_ci=(0.99, 1.01)),
        ConfigResult(big, "float16", Verdict.PASS, ms=0.95, baseline_ms=0.93,
                     baseline_name="sdpa", speedup=0.979, speedup_ci=(0.975, 0.983),
                     times=timed(0.95, 0.95, 0.005), rival_times=timed(0.95, 0.95, 0.005),
                     baseline_times={"sdpa": Times(kernel_ms=0.93, call_ms=0.93)},
                     gain=1.0, gain_ci=(0.995, 1.005)))
    return EvalResult(Verdict.PASS, "ok", 1.17, configs, timing="call", baseline="best",
                      rival="seed.py", rival_fitness=1.17, gain=1.0, gain_ci=(0.995, 1.005))


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
    from evoattn.contract.request import EvalRequest
    sandbox: dict[str, object] = {"cache_dir": cache_dir, "spare": spare}
    if zygote is not None:
        sandbox["zygote"] = zygote
    if max_host_mem_bytes is not None:
        sandbox["max_host_mem_bytes"] = max_host_mem_bytes
    if request.get("configs") is not None:
        request["configs"] = tuple(request["configs"])  # type: ignore[arg-type]
    return SubprocessEvaluator(EvalRequest(**request), SandboxSettings(**sandbox))  # type: ignore
