"""The host cross-check's rounds: a transient stall is measured again, hidden work is not forgiven."""
from __future__ import annotations

from evaluator.hidden_work import HOST_ROUNDS, hidden_work, settled_host_time


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
    from evaluator.spin import WARPS_PER_BLOCK, blocks_for
    assert WARPS_PER_BLOCK * 32 == 512
    assert blocks_for(132) == 4 * 132             # H100/H200: 2,048 threads per SM
    assert blocks_for(84, 1536) == 3 * 84         # sm_86/89: 1,536
    assert blocks_for(10, 1024) == 2 * 10
