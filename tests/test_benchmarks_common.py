"""benchmarks.common: the helpers the benchmarks share, on the CPU."""
from __future__ import annotations

from benchmarks import common


def test_interleaved_rounds_reverse_the_order_every_round_and_keep_each_functions_samples():
    calls: list[str] = []

    def measure(name: str) -> float:
        calls.append(name)
        return float(len(calls))

    samples = common.interleaved_samples({"a": "a", "b": "b", "c": "c"}, measure, rounds=3)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert samples == {"a": [1.0, 6.0, 7.0], "b": [2.0, 5.0, 8.0], "c": [3.0, 4.0, 9.0]}
    assert common.interleaved({"a": "a", "b": "b"}, lambda n: {"a": 1.0, "b": 3.0}[n]) == \
        {"a": 1.0, "b": 3.0}


def test_a_config_is_labelled_by_its_problem_and_an_unknown_problem_gets_the_plain_label():
    cfg = {"B": 1, "H": 2, "S": 64, "D": 64, "causal": True}
    assert common.label("sdpa", cfg) == "(1,2,64,64) causal"
    assert common.label("no_such_problem", {"B": 1, "S": 8}) == "B=1,S=8"
    assert common.label("missing/problem.py", {"B": 1}) == "B=1"


def test_the_geometric_mean_leaves_out_missing_values_and_is_none_without_any():
    assert common.geomean([2.0, None, 8.0, 0.0]) == 4.0
    assert common.geomean([None, 0.0]) is None


def test_eager_ms_times_one_call_per_input_set_after_a_warm_up_round():
    seen: list[int] = []
    ms = common.eager_ms(seen.append, [1, 2, 3], rounds=2)
    assert seen == [1, 2, 3] * 3 and ms >= 0.0
