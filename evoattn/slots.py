"""What every evaluation slot of a run is made from, on this machine or on a Dask worker.

    SlotSpec       the run's request, the secrets' names, the deadline rule, the station and
                   the plain protocol: built once from the config (slot_spec), read by both
                   backends, so a slot (a SubprocessEvaluator) is the same whichever pool
                   runs it
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from evoattn.contract.request import EvalRequest
from evoattn.contract.types import EvalResult

from .childenv import SandboxSettings
from .sandbox import SubprocessEvaluator, run_deadline


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    """How a run's slots evaluate: the same on every backend."""

    request: EvalRequest
    secret_names: tuple[str, ...]       # variables a candidate must never see
    run_factor: float                   # the run deadline: factor × the seed's run stages,
    run_floor_s: float                  # at least this (sandbox.run_deadline)
    station_refresh_s: float | None     # a station timing the baselines (None: none)
    # The request fields a plain candidate (one without a rival) takes instead of `request`'s
    # (a run's candidate_width, candidate_graph, candidate_heat); duels keep `request`.
    plain: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    spare: bool = False                 # a GPU slot keeps spare children (SandboxSettings)

    def slot(self, visible_device: str | None = None, share: int = 1,
             timing_cpus: tuple[int, ...] = ()) -> SubprocessEvaluator:
        """Returns one slot: its children see only `visible_device` (a GPU id; None: what this
        process sees), take turns on it with the other `share` - 1 slots of that GPU and time
        on the fastest of `timing_cpus` (empty: of any CPU). Spares need the GPU's id, which
        names the lock that keeps their set-up out of the others' timing."""
        sandbox = SandboxSettings(secret_env_names=self.secret_names,
                                  visible_device=visible_device,
                                  station_refresh_s=self.station_refresh_s, gpu_share=share,
                                  timing_cpus=tuple(timing_cpus),
                                  spare=self.spare and visible_device is not None,
                                  run_factor=self.run_factor, run_floor_s=self.run_floor_s)
        return SubprocessEvaluator(self.request, sandbox, dict(self.plain))

    def deadline_s(self, seed: EvalResult) -> float:
        """Returns the run-stage deadline of every candidate after this seed."""
        return run_deadline(seed, self.run_factor, self.run_floor_s, self.request.run_timeout_s)

    def calibrated(self, seed: EvalResult) -> "SlotSpec":
        """Returns the spec whose request carries the deadline derived from the seed."""
        return dataclasses.replace(self, request=dataclasses.replace(
            self.request, run_timeout_s=self.deadline_s(seed)))

    def to_json(self) -> dict[str, Any]:
        """Returns the spec as JSON (what a Dask task carries: names of secrets, no values)."""
        return {"request": self.request.to_json(), "secret_names": list(self.secret_names),
                "run_factor": self.run_factor, "run_floor_s": self.run_floor_s,
                "station_refresh_s": self.station_refresh_s, "plain": dict(self.plain),
                "spare": self.spare}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "SlotSpec":
        """Returns the spec to_json() wrote."""
        return cls(EvalRequest.from_json(data["request"]), tuple(data["secret_names"]),
                   float(data["run_factor"]), float(data["run_floor_s"]),
                   data["station_refresh_s"], dict(data["plain"]), bool(data["spare"]))


def slot_spec(cfg: Any, request: EvalRequest, secret_names: tuple[str, ...]) -> SlotSpec:
    """Returns the slots' spec a run config asks for (evaluator.* keys)."""
    ev = cfg.evaluator
    return SlotSpec(request, tuple(secret_names), ev.run_factor, ev.run_floor_s,
                    ev.baseline_refresh_s if ev.station else None,
                    {"width": ev.candidate_width, "graph": ev.candidate_graph,
                     "heat": ev.candidate_heat},
                    ev.spare)
