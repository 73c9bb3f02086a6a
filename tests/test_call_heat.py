"""Call mode's heat: on a GPU a batch of heavy calls follows about HEAT_MS of untimed calls on an
input set of their own (the GPU at the clocks of sustained work); light calls and the CPU timer
have none."""
from __future__ import annotations

import random

import torch

import pytest

from evoattn.child.timing import HEAT_MIN_MS, HEAT_MS, CpuTimer, GpuTimer, InputSets, Plan, _Timer


class _Recorder(_Timer):
    heat = True

    def __init__(self) -> None:
        self.torch = torch
        self.log: list[str] = []
        self.sync = lambda: self.log.append("sync")


@pytest.mark.parametrize("per_call_ms, planned, heat", [
    (HEAT_MS / 4, True, 4), (HEAT_MS / 4.5, True, 5), (HEAT_MIN_MS / 2, True, 0), (0.0, True, 0),
    (HEAT_MS / 4, False, 0)])                   # a plan without heat (a run's plain candidate)
def test_heavy_batches_follow_untimed_calls_on_the_heat_set(per_call_ms: float, planned: bool,
                                                            heat: int) -> None:
    base = {"q": torch.zeros(4), "k": torch.zeros(4)}
    sets = InputSets(base, ("q", "k"), 3, lambda s: s["q"].normal_(),
                     lambda b: b["q"].normal_())
    assert len(sets.sets) == 3
    heat_ptr = sets.heat["q"].data_ptr()
    assert heat_ptr not in {s["q"].data_ptr() for s in sets.sets}
    timer = _Recorder()

    def fn(inputs: dict) -> torch.Tensor:
        timer.log.append("heat" if inputs["q"].data_ptr() == heat_ptr else "timed")
        return inputs["q"] + 1
    plan = Plan(warmup=0, reps=2, rounds=2, graph_rounds=0, sets=3, graph=False, heat=planned)
    samples, _ = timer._call_mode({"f": fn}, sets, plan, "f", random.Random(0), [],
                                  lambda m, s: False, per_call_ms)
    assert len(samples["f"]) == 2
    # a warm-up batch and two timed ones: each the heat, a sync, timed x3, a sync
    assert timer.log == (["heat"] * heat + ["sync"] + ["timed"] * 3 + ["sync"]) * 3


def test_only_the_gpu_timer_heats() -> None:
    assert GpuTimer.heat is True and CpuTimer.heat is False


def test_one_heat_call_is_kept_for_checking_where_timed_outputs_are() -> None:
    """A candidate that skipped the untimed calls would be timed at boost clocks: in the rounds
    whose timed outputs are re-checked, one heat call's output is kept with its inputs."""
    base = {"q": torch.zeros(4), "k": torch.zeros(4)}
    sets = InputSets(base, ("q", "k"), 3, lambda s: s["q"].normal_(),
                     lambda b: b["q"].normal_())
    timer = _Recorder()
    kept: list = []
    plan = Plan(warmup=0, reps=4, rounds=4, graph_rounds=0, sets=3, graph=False, heat=True)
    timer._call_mode({"f": lambda inp: inp["q"] + 1, "g": lambda inp: inp["q"] * 2}, sets,
                     plan, "f", random.Random(0), kept, lambda m, s: False, HEAT_MS / 4)
    heat = [k for k in kept if k.what.startswith("untimed call")]
    assert len(heat) == 2                               # rounds 0 and 1, `keep`'s batches only
    for k in heat:
        assert torch.equal(k.output, k.inputs["q"] + 1)
        assert k.inputs["q"].data_ptr() != sets.heat["q"].data_ptr()   # a snapshot
    assert any(k.what.startswith("timed call") for k in kept)
