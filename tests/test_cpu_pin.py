"""The timing thread's CPU: the fastest of its set, measured on each, held until release, and
picked again when it slows (real sched_setaffinity; the speeds are given per CPU)."""
from __future__ import annotations

import os
import threading

import pytest

from evoattn.child.cpu_pin import SLOWER, TimingCpu, cpu_blocks, interpreter_work, median_seconds

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                reason="no sched_setaffinity (Linux only)")
ALL = sorted(os.sched_getaffinity(0))


def _speeds(table: dict[int, float], asked: list[int]):
    """A speed probe reading the CPU this thread is pinned to (one, while TimingCpu probes)."""
    def speed() -> float:
        (cpu,) = os.sched_getaffinity(0)
        asked.append(cpu)
        return table[cpu]
    return speed


@pytest.mark.skipif(len(ALL) < 2, reason="needs two CPUs")
def test_the_thread_runs_on_the_fastest_cpu_until_released() -> None:
    a, b = ALL[0], ALL[1]
    for fast, slow in ((b, a), (a, b)):
        asked: list[int] = []
        cpu = TimingCpu([a, b], speed=_speeds({fast: 1.0, slow: 1.6}, asked))
        try:
            assert cpu.pick() == fast and os.sched_getaffinity(0) == {fast}
            assert sorted(asked) == [a, b] and cpu.spread() == pytest.approx(1.6)
        finally:
            cpu.release()
        assert sorted(os.sched_getaffinity(0)) == ALL and cpu.cpu is None


@pytest.mark.skipif(len(ALL) < 2, reason="needs two CPUs")
def test_a_cpu_that_slows_is_left_for_the_fastest_and_a_small_change_is_not() -> None:
    a, b = ALL[0], ALL[1]
    table = {a: 1.0, b: 1.2}
    asked: list[int] = []
    cpu = TimingCpu([a, b], speed=_speeds(table, asked))
    try:
        assert cpu.pick() == a
        table[a] = 1.0 * SLOWER * 0.99             # within the margin: stays, one probe only
        asked.clear()
        assert cpu.refresh() == a and asked == [a]
        table[a] = 1.5                              # another tenant took it
        assert cpu.refresh() == b and os.sched_getaffinity(0) == {b}
    finally:
        cpu.release()


@pytest.mark.skipif(len(ALL) < 2, reason="needs two CPUs")
def test_after_a_config_a_slowed_cpu_is_named_and_left_for_the_fastest() -> None:
    a, b = ALL[0], ALL[1]
    table = {a: 1.0, b: 1.2}
    cpu = TimingCpu([a, b], speed=_speeds(table, []))
    try:
        assert cpu.slowed() is None                 # nothing pinned yet: nothing to say
        assert cpu.pick() == a
        table[a] = SLOWER * 0.99
        assert cpu.slowed() is None and cpu.cpu == a
        table[a] = 1.5
        why = cpu.slowed()
        assert why is not None and f"({a})" in why and "1.50x slower" in why
        assert cpu.cpu == b and os.sched_getaffinity(0) == {b}
        assert cpu.slowed() is None                 # measured against its new pick
    finally:
        cpu.release()


def test_only_the_given_cpus_are_probed_and_other_threads_keep_theirs() -> None:
    one = ALL[-1]
    asked: list[int] = []
    cpu = TimingCpu([one, 10_000], speed=_speeds({one: 1.0}, asked))   # 10000: not ours
    seen: list[set[int]] = []
    try:
        assert cpu.pick() == one and asked == [one]
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        # a thread started now inherits the pinned mask; one that existed keeps its own:
        # the pin is per thread (pid 0), not the process's
        assert seen == [{one}]
        before: list[set[int]] = []
        go = threading.Event()
        done = threading.Event()

        def older() -> None:
            go.wait()
            before.append(os.sched_getaffinity(0))
            done.set()
        cpu.release()
        t2 = threading.Thread(target=older)
        t2.start()                                  # started unpinned
        cpu.pick()
        go.set()
        done.wait(10)
        t2.join()
        assert before == [set(ALL)]
    finally:
        cpu.release()


def test_a_refused_pin_leaves_the_thread_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(pid: int, cpus: set[int]) -> None:
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    cpu = TimingCpu(speed=lambda: 1.0)
    assert cpu.pick() is None and cpu.cpu is None
    cpu.release()
    assert sorted(os.sched_getaffinity(0)) == ALL


def test_the_probe_is_real_work_and_its_median_is_positive() -> None:
    t = median_seconds(interpreter_work, 3)
    assert median_seconds(lambda: None, 3) < t < 0.5


def test_a_machine_s_gpus_get_disjoint_contiguous_blocks() -> None:
    assert cpu_blocks(range(16), 2) == [tuple(range(8)), tuple(range(8, 16))]
    assert cpu_blocks(range(16), 3) == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9), (10, 11, 12, 13, 14, 15)]
    assert cpu_blocks([3, 1], 1) == [(1, 3)]
    assert cpu_blocks([0], 4) == [(0,)] * 4         # fewer CPUs than GPUs: all share


def test_the_request_carries_its_cpus_and_the_config_its_switch() -> None:
    from evoattn.contract.request import EvalRequest
    r = EvalRequest(timing_cpus=(2, 5), pin_cpu=False)
    back = EvalRequest.from_json(r.to_json())
    assert back == r and back.timing_cpus == (2, 5)
    from evoattn.problems import get_problem
    from evoattn import settings
    from evoattn.config import EvaluatorConfig
    assert EvaluatorConfig().pin_cpu is True and EvalRequest().pin_cpu is True
    prob = get_problem("sdpa")
    for on in (True, False):
        req = settings.eval_request("sdpa", prob, "cuda", None, None, EvaluatorConfig(pin_cpu=on))
        assert req.pin_cpu is on


def test_the_timing_records_its_cpu_in_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from evoattn.child import harness
    s = SimpleNamespace(common={"device_info": {}})
    cpu = TimingCpu([ALL[0]], speed=lambda: 120e-6)
    try:
        assert harness._timing_cpu(s, cpu) is cpu
        assert s.common["device_info"] == {"timing_cpu": ALL[0], "cpus_probed": 1,
                                           "cpu_speed_spread": 1.0, "cpu_probe_us": 120.0}
    finally:
        cpu.release()
    assert harness._timing_cpu(s, None) is None


def test_a_gpu_s_block_is_its_own_by_its_index_on_the_machine() -> None:
    from evoattn.child.cpu_pin import gpu_block
    cpus = range(16)
    # two runs (or Dask workers) on one 2-GPU machine, each seeing one GPU: disjoint blocks
    assert gpu_block("0", 0, 1, cpus, host_gpus=2) == tuple(range(8))
    assert gpu_block("1", 0, 1, cpus, host_gpus=2) == tuple(range(8, 16))
    # one run with both: the same blocks by their ids
    assert [gpu_block(g, i, 2, cpus, host_gpus=2) for i, g in enumerate("01")] == \
        [tuple(range(8)), tuple(range(8, 16))]
    # an id that is not an index of the machine's GPUs (a UUID, or no driver listing): by place
    assert gpu_block("GPU-8f3c", 1, 2, cpus, host_gpus=2) == tuple(range(8, 16))
    assert gpu_block("1", 1, 2, cpus, host_gpus=0) == tuple(range(8, 16))     # 0: unknown
    assert gpu_block("3", 0, 1, cpus, host_gpus=2) == tuple(range(16))
    assert gpu_block("0", 0, 1, [5], host_gpus=4) == (5,)       # fewer CPUs than GPUs: shared
