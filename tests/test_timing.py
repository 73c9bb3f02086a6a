"""The host cross-check's rounds: a transient stall is measured again, hidden work is not forgiven."""
from __future__ import annotations

from evoattn.child.hidden_work import HOST_ROUNDS, hidden_work, settled_host_time


def _rounds(values: list[tuple[float, float]]):  # noqa: ANN202
    calls = []

    def measure() -> tuple[float, float]:
        calls.append(1)
        return values[len(calls) - 1]
    return measure, calls


def test_a_stalled_round_is_measured_again_and_the_fast_one_counts() -> None:
    # the masked seed on the H200: events 0.556 ms, one round at 1.71 ms per call (a stall)
    measure, calls = _rounds([(1.71, 0.34), (0.58, 0.33), (0.57, 0.33)])
    host, launch = settled_host_time(measure, 0.556)
    assert (host, launch) == (0.58, 0.33) and len(calls) == 2
    assert not hidden_work(0.556, host, launch)


def test_hidden_work_shows_in_every_round_and_stays_flagged() -> None:
    measure, calls = _rounds([(1.8, 0.02), (1.7, 0.02), (1.75, 0.02)])
    host, launch = settled_host_time(measure, 0.5)
    assert host == 1.7 and len(calls) == HOST_ROUNDS
    assert hidden_work(0.5, host, launch)


def test_a_clean_round_ends_it_even_when_an_earlier_one_was_faster() -> None:
    # round 2 returns slowly (a host-bound call), so its per-call time is explained: clean
    measure, calls = _rounds([(1.0, 0.3), (1.1, 0.8), (1.05, 0.3)])
    assert settled_host_time(measure, 0.5) == (1.1, 0.8) and len(calls) == 2


def test_an_honest_first_round_is_not_repeated() -> None:
    measure, calls = _rounds([(0.6, 0.1)])
    assert settled_host_time(measure, 0.55) == (0.6, 0.1) and len(calls) == 1


def test_the_spin_fills_every_thread_slot_of_every_sm() -> None:
    from evoattn.child.spin import WARPS_PER_BLOCK, blocks_for
    assert WARPS_PER_BLOCK * 32 == 512
    assert blocks_for(132) == 4 * 132             # H100/H200: 2,048 threads per SM
    assert blocks_for(84, 1536) == 3 * 84         # sm_86/89: 1,536
    assert blocks_for(10, 1024) == 2 * 10


class _HostWatchingTimer:
    """The shared call mode of the timers on the CPU, watching the host as the GPU timer does."""

    @staticmethod
    def make(watch: bool):  # noqa: ANN205
        import torch

        from evoattn.child import timing

        class Timer(timing._Timer):
            watch_host = watch

            def __init__(self) -> None:
                self.torch, self.sync = torch, lambda: None
        return Timer()


def _call_mode_with_busy_batches(monkeypatch, busy: list[bool], watch: bool = True):  # noqa: ANN202
    """Runs 5 call-mode rounds of two functions; `busy` says, batch by batch (the two warm-up
    batches first), whether the timing thread lost its CPU while launching."""
    import random

    import torch

    from evoattn.child import timing
    schedule, state = iter(busy), {"reads": 0, "busy": False}

    def thread_cpu() -> float:            # read at a batch's start, then after its launches
        state["reads"] += 1
        if state["reads"] % 2:
            state["busy"] = next(schedule, False)
            return 0.0
        return 0.0 if state["busy"] else 1e9
    monkeypatch.setattr(timing, "_thread_cpu", thread_cpu)
    timer = _HostWatchingTimer.make(watch)
    picks: list[int] = []
    timer.on_busy_host = lambda: picks.append(1)
    inputs = {"x": torch.ones(4)}
    fns = {"candidate": lambda inp: inp["x"] + 1, "baseline:sdpa": lambda inp: inp["x"] * 2}
    sets = timing.InputSets(inputs, ("x",), 2, lambda inp: None)
    plan = timing.Plan(warmup=0, reps=5, rounds=5, graph_rounds=0, sets=2, graph=False)
    samples, _ = timer._call_mode(fns, sets, plan, "candidate", random.Random(0), [],
                                  lambda m, s: False)
    return timer, samples, picks


def test_a_call_round_whose_launches_lost_their_cpu_is_measured_again(monkeypatch) -> None:
    # warm-ups idle; round 1's first batch busy: that round again, once, after a CPU re-pick
    timer, samples, picks = _call_mode_with_busy_batches(monkeypatch, [False, False, True])
    assert timer.rounds_redone == 1 and len(picks) == 1
    assert {n: len(v) for n, v in samples.items()} == {"candidate": 5, "baseline:sdpa": 5}


def test_a_host_busy_throughout_ends_each_round_after_its_tries(monkeypatch) -> None:
    from evoattn.child.timing import ROUND_TRIES
    timer, samples, picks = _call_mode_with_busy_batches(monkeypatch, [True] * 1000)
    assert timer.rounds_redone == 5 * (ROUND_TRIES - 1) == len(picks)
    assert all(len(v) == 5 for v in samples.values())


def test_a_timer_that_does_not_watch_the_host_measures_each_round_once(monkeypatch) -> None:
    from evoattn.child.timing import CpuTimer, GpuTimer
    assert GpuTimer.watch_host is True and CpuTimer.watch_host is False
    timer, samples, picks = _call_mode_with_busy_batches(monkeypatch, [True] * 1000, watch=False)
    assert timer.rounds_redone == 0 and not picks
    assert all(len(v) == 5 for v in samples.values())


def test_call_mode_keeps_the_time_its_calls_took_to_issue_apart_from_their_time(
        monkeypatch) -> None:
    """Per round, call mode keeps what the host took to issue a batch's calls beside the
    batch's time per call: a GPU-bound function (its batch waits at the final sync) issues
    far below its call time, a host-bound one near it; Times carries the median."""
    import random

    import torch

    from evoattn.child import timing
    now = [0.0]
    monkeypatch.setattr(timing, "_perf", lambda: now[0])
    monkeypatch.setattr(timing, "_thread_cpu", lambda: now[0])
    gpu_left = [0.0]            # seconds of queued GPU work the next sync waits for

    class Timer(timing._Timer):
        def __init__(self) -> None:
            self.torch = torch

        def sync(self) -> None:
            now[0] += gpu_left[0]
            gpu_left[0] = 0.0

    def call(host_s: float, gpu_s: float):  # noqa: ANN202
        def fn(inp: dict) -> torch.Tensor:
            now[0] += host_s
            gpu_left[0] = max(0.0, gpu_left[0] - host_s) + gpu_s
            return inp["x"] + 1
        return fn
    fns = {"candidate": call(10e-6, 40e-6), "baseline:sdpa": call(30e-6, 5e-6)}
    sets = timing.InputSets({"x": torch.ones(4)}, ("x",), 4, lambda inp: None)
    plan = timing.Plan(warmup=0, reps=4, rounds=4, graph_rounds=0, sets=4, graph=False)
    samples, issued = Timer()._call_mode(fns, sets, plan, "candidate", random.Random(0), [],
                                         lambda m, s: False)
    assert {n: len(v) for n, v in issued.items()} == {"candidate": 4, "baseline:sdpa": 4}
    cand = timing._times("candidate", {"call": samples}, "", None, issued["candidate"])
    base = timing._times("baseline:sdpa", {"call": samples}, "", None, issued["baseline:sdpa"])
    assert abs(cand.issue_us - 10) < 1e-6 and cand.call_ms > 3 * cand.issue_us * 1e-3
    assert abs(base.issue_us - 30) < 1e-6 and abs(base.call_ms * 1e3 - 31.25) < 1e-6


def test_eval_names_the_configs_whose_call_times_the_host_set() -> None:
    """`evoattn eval` names host-bound configs (the candidate's or its baseline's calls issued
    at about their rate): on a GPU in call time only."""
    import dataclasses

    from evoattn.contract.types import ConfigResult, EvalResult, Times, Verdict
    from evoattn.report import host_bound_lines

    def config(s: int, ours: float, theirs: float) -> ConfigResult:  # issued share of the call
        return ConfigResult({"B": 1, "H": 8, "S": s, "D": 64}, "float16", Verdict.PASS,
                            times=Times(call_ms=0.020, issue_us=20 * ours),
                            baseline_name="sdpa",
                            baseline_times={"sdpa": Times(call_ms=0.030, issue_us=30 * theirs)})
    result = EvalResult(Verdict.PASS, "", 1.0, (config(512, 0.98, 0.97), config(1024, 0.3, 0.85),
                                               config(2048, 0.3, 0.5), config(4096, 0.79, 0.2)),
                        timing="call", timing_device="cuda")
    (line,) = host_bound_lines(result)
    assert "(1,8,512,64), (1,8,1024,64)" in line and "2048" not in line and "4096" not in line
    for other in (dict(timing="kernel"), dict(timing_device="cpu")):
        assert host_bound_lines(dataclasses.replace(result, **other)) == []
    assert host_bound_lines(dataclasses.replace(result, configs=result.configs[2:])) == []
