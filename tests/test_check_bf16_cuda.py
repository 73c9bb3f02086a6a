"""benchmarks.check_bf16_cuda's verdicts, on the CPU with stand-in implementations and routes
(the script itself runs on a GPU: tests/test_wgmma_gpu.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import label

ROOT = Path(__file__).resolve().parents[1]
MODULE = "benchmarks.check_bf16_cuda"
CFGS = [({"B": 1, "H": 2, "S": 33, "D": 64, "causal": True}, True),
        ({"B": 1, "H": 1, "S": 17, "D": 128, "causal": False}, True)]


@pytest.fixture(scope="module")
def script():
    from benchmarks import check_bf16_cuda
    return check_bf16_cuda


def _reference_in_dtype(inputs, cfg):
    """The float32 answer rounded to the input dtype: within any tolerance the rule gives."""
    from evoattn.problems import get_problem
    return get_problem("sdpa").reference(inputs, cfg).to(inputs["q"].dtype)


def _zeros(inputs, cfg):
    import torch
    return torch.zeros_like(inputs["q"])


def _route_by_dtype(routes):
    def route(run, inputs, cfg):
        return routes[str(inputs["q"].dtype)], run(inputs, cfg)
    return route


def test_rows_pass_within_the_bound_and_fail_outside_it(script):
    rows = script.check({"good": _reference_in_dtype, "zeros": _zeros}, set(), 1, False, CFGS,
                        device="cpu", route=_route_by_dtype(
                            {"torch.float16": "wgmma", "torch.bfloat16": "wgmma"}))
    assert len(rows) == 2 * 2 * 2                 # impls x configs x dtypes
    assert {r["dtype"] for r in rows} == {"float16", "bfloat16"}
    for r in rows:
        assert 0 < r["bound"] < 0.1               # 2 x torch's error + 1e-5, not a constant
        assert r["ok"] == (r["impl"] == "good"), r
    assert all("> bound" in r["why"] for r in rows if r["impl"] == "zeros")


def test_bfloat16_routed_away_from_float16s_kernel_fails(script):
    rows = script.check({"hybrid": _reference_in_dtype}, set(), 1, False, CFGS[:1],
                        device="cpu", route=_route_by_dtype(
                            {"torch.float16": "wgmma-ws", "torch.bfloat16": "triton"}))
    by = {r["dtype"]: r for r in rows}
    assert by["float16"]["ok"]
    assert not by["bfloat16"]["ok"] and "float16 took wgmma-ws" in by["bfloat16"]["why"]


def test_a_seed_on_hopper_must_run_a_tensor_core_kernel(script):
    route = _route_by_dtype({"torch.float16": "cuda-core", "torch.bfloat16": "cuda-core"})
    rows = script.check({"wgmma_flash.cu": _reference_in_dtype}, {"wgmma_flash.cu"}, 1, True,
                        CFGS[:1], device="cpu", route=route)
    assert rows and all(not r["ok"] and "cuda-core" in r["why"] for r in rows)
    rows = script.check({"wgmma_flash.cu": _reference_in_dtype}, {"wgmma_flash.cu"}, 1, False,
                        CFGS[:1], device="cpu", route=route)      # not Hopper: no wgmma to ask for
    assert all(r["ok"] for r in rows)


def test_the_cases_cover_both_head_dims_causality_and_odd_lengths_once_each(script):
    cases = script.all_cases()
    labels = [label("sdpa", c) for c, _ in cases]
    assert len(labels) == len(set(labels))
    for d in (64, 128):
        for causal in (False, True):
            assert any(c["D"] == d and c["causal"] == causal and c["S"] % 2 for c, _ in cases), \
                (d, causal)
    assert any(c["S"] == 1 for c, _ in cases)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, "-m", MODULE, "--no-timing"], capture_output=True,
                          cwd=ROOT, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["check_bf16_cuda: needs a CUDA GPU"]


def test_a_call_the_profiler_saw_no_kernel_of_fails_unless_routes_are_off(script):
    rows = script.check({"hybrid": _reference_in_dtype}, set(), 1, True, CFGS[:1], device="cpu",
                        route=_route_by_dtype({"torch.float16": "none", "torch.bfloat16": "none"}))
    assert all(not r["ok"] and "--no-routes" in r["why"] for r in rows)
    rows = script.check({"wgmma_flash.cu": _reference_in_dtype}, {"wgmma_flash.cu"}, 1, True,
                        CFGS[:1], device="cpu", route=script.no_route)
    assert [r["route"] for r in rows] == ["-", "-"] and all(r["ok"] for r in rows)


def test_the_program_over_its_rival_is_the_rivals_time_over_the_programs_per_config(script):
    a, b = CFGS[0][0], CFGS[1][0]
    rows = [{"impl": "p", "cfg": a, "dtype": "float16", "ms": 2.0},
            {"impl": "r", "cfg": a, "dtype": "float16", "ms": 3.0},
            {"impl": "p", "cfg": b, "dtype": "float16", "ms": 4.0},
            {"impl": "r", "cfg": b, "dtype": "float16", "ms": 2.0},
            {"impl": "p", "cfg": a, "dtype": "bfloat16", "ms": 1.0},
            {"impl": "r", "cfg": a, "dtype": "bfloat16", "ms": 5.0}]
    assert script.pair_gains(rows, "p", "r", "float16") == [1.5, 0.5]
    assert script.pair_gains(rows, "p", "r", "bfloat16") == [5.0]
    assert script.pair_gains(rows, "r", "p", "bfloat16") == [0.2]
