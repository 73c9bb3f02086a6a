"""The `model` problem (Gemma 2 / GPT-OSS / Mistral / Llama prefill) and its Triton seed.

The contract's edges are checked against a naive float64 loop written here; the seed runs in
a child process (this file as a script) with TRITON_INTERPRET=1 set before Triton is
imported, as tests/test_seeds_triton.py explains; `evoattn eval` runs end to end on the CPU.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "seeds" / "model" / "model_triton.py"


def _cfg(b: int, h: int, hkv: int, s: int, d: int, window: int = 0, softcap: float = 0.0,
         sinks: bool = False) -> dict[str, Any]:
    return {"B": b, "H": h, "Hkv": hkv, "S": s, "D": d, "window": window, "softcap": softcap,
            "sinks": sinks}


# ---- an independent float64 answer ----------------------------------------------------
def naive(q: Any, k: Any, v: Any, scale: float, window: int, softcap: float,
          sinks: Any) -> Any:
    """Returns the contract's answer row by row in float64, keys listed one by one."""
    import torch
    B, H, S, D = q.shape
    G = H // k.shape[1]
    out = torch.zeros(B, H, S, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(S):
                keys = [j for j in range(S) if j <= i and (window == 0 or i - window < j)]
                kk, vv = k[b, h // G, keys].double(), v[b, h // G, keys].double()
                s = kk @ q[b, h, i].double() * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                w = torch.exp(s)
                den = w.sum() + (math.exp(float(sinks[h])) if sinks is not None else 0.0)
                out[b, h, i] = (w[:, None] * vv).sum(0) / den
    return out


def _inputs(cfg: dict[str, Any], dtype: str = "float16", seed: int = 0) -> dict[str, Any]:
    import torch
    from evoattn.problems import get_problem
    return get_problem("model").make_inputs(cfg, getattr(torch, dtype), torch.device("cpu"),
                                            torch.Generator().manual_seed(seed))


def _naive_of(inputs: dict[str, Any]) -> Any:
    return naive(inputs["q"], inputs["k"], inputs["v"], inputs["scale"], inputs["window"],
                 inputs["softcap"], inputs["sinks"])


def _label(cfg: dict[str, Any]) -> str:
    from evoattn.problems import get_problem
    return get_problem("model").label(cfg)


EDGE_CASES = [
    _cfg(1, 2, 1, 13, 64, window=1),                      # a row sees itself only
    _cfg(1, 2, 2, 13, 64, window=4),
    _cfg(1, 2, 1, 13, 64, window=12),                     # S - 1: only the last row loses one
    _cfg(1, 2, 1, 13, 64, window=13),                     # S: plain causal
    _cfg(1, 2, 1, 13, 64, window=40),                     # larger than S
    _cfg(2, 6, 2, 9, 128, softcap=0.7),                   # an active cap, GQA 3:1
    _cfg(1, 4, 1, 11, 64, window=3, sinks=True),          # multi-query, sinks
    _cfg(1, 4, 2, 7, 256, window=2, softcap=1.5, sinks=True),
]


@pytest.mark.parametrize("cfg", EDGE_CASES, ids=_label)
def test_reference_matches_a_naive_float64_implementation(cfg: dict[str, Any]) -> None:
    from evoattn.problems import get_problem
    inputs = _inputs(cfg)
    ref = get_problem("model").reference(inputs, cfg)
    assert (ref.double() - _naive_of(inputs)).abs().max().item() < 1e-5


def test_a_dominant_sink_takes_almost_all_of_a_row() -> None:
    # Window 1: a row's only key scores ~N(0, 1), head 0's sink is 10, so the row keeps a
    # weight near e^-10 and its output nearly vanishes; the other heads' sinks are ~N(0, 1).
    from evoattn.problems import get_problem
    from evoattn.problems.model_prefill import DOMINANT_SINK
    cfg = _cfg(1, 4, 2, 16, 64, window=1, sinks=True)
    inputs = _inputs(cfg)
    assert float(inputs["sinks"][0]) == DOMINANT_SINK
    ref = get_problem("model").reference(inputs, cfg)
    assert (ref.double() - _naive_of(inputs)).abs().max().item() < 1e-5
    v = inputs["v"].float()
    assert ref[0, 0].abs().max() < 0.01 * v[0, 0].abs().max()
    assert ref[0, 1:].abs().max() > 0.1 * v[0].abs().max()


def test_the_window_edge_is_transformers_sliding_window_causal_mask() -> None:
    masking = pytest.importorskip("transformers.masking_utils")
    import torch
    from evoattn.problems.model_prefill import visible
    i, j = torch.arange(20)[:, None], torch.arange(20)[None, :]
    zero = torch.tensor(0)
    for w in (1, 2, 5, 19, 20, 33):
        theirs = masking.sliding_window_causal_mask_function(w)(zero, zero, i, j)
        assert torch.equal(visible(i, j, w), theirs), w


def test_flops_count_the_visible_pairs() -> None:
    from evoattn.problems import get_problem
    from evoattn.problems.model_prefill import visible_pairs
    for S in (1, 7, 64):
        for w in (0, 1, 3, S - 1, S, S + 9):
            expected = sum(min(i + 1, w) if w > 0 else i + 1 for i in range(S))
            assert visible_pairs(S, w) == expected, (S, w)
    cfg = _cfg(2, 8, 4, 100, 256, window=10)
    assert get_problem("model").flops(cfg) == 4.0 * 2 * 8 * 256 * visible_pairs(100, 10)


@pytest.mark.parametrize("change, key", [
    ({"D": 96}, "D"), ({"H": 6, "Hkv": 4}, "H"), ({"window": -1}, "window"),
    ({"softcap": -2.0}, "softcap"), ({"Hq": 8}, "Hq"), ({"S": 0}, "S"),
])
def test_configs_outside_the_contract_name_their_key(change: dict[str, Any], key: str) -> None:
    from evoattn.problems.model_prefill import shape_of
    with pytest.raises(ValueError, match=key):
        shape_of({**_cfg(1, 4, 2, 16, 64), **change})


def test_default_configs_are_the_models_derived_shapes() -> None:
    from evoattn.problems import get_problem
    from evoattn.problems.model_prefill import shape_of
    shapes = [shape_of(c) for c in get_problem("model").default_configs]
    gemma = [s for s in shapes if s.D == 256]
    oss = [s for s in shapes if s.sinks]
    assert len(gemma) + len(oss) == len(shapes)
    assert all((s.H, s.Hkv, s.softcap, s.scale) == (8, 4, 50.0, 256 ** -0.5) for s in gemma)
    assert any(s.window == 4096 < s.S for s in gemma)
    assert all((s.H, s.Hkv, s.D, s.window in (0, 128)) == (64, 8, 64, True) for s in oss)
    assert {s.S for s in shapes} == {1024, 2048, 4096, 8192}
    assert all(s.B * s.S <= 16 * 1024 for s in shapes)


@pytest.mark.parametrize("cfg, sdpa_runs", [
    (_cfg(1, 4, 2, 40, 64, window=7), True),
    (_cfg(1, 4, 2, 40, 64), True),
    (_cfg(1, 2, 1, 40, 256, window=9, softcap=2.0), False),
    (_cfg(1, 4, 2, 40, 64, window=7, sinks=True), False),
])
def test_baselines_compute_the_contract(cfg: dict[str, Any], sdpa_runs: bool) -> None:
    from evoattn.child.measure import applies
    from evoattn.problems import get_problem
    problem = get_problem("model")
    inputs = _inputs(cfg)
    want = _naive_of(inputs)
    timed = {n: f for n, f in problem.baselines().items() if applies(f, cfg)}
    assert ("sdpa" in timed) == sdpa_runs
    assert {"eager", "flex_attention"} <= set(timed)
    for name, fn in timed.items():
        out = fn(inputs, cfg)
        assert out.shape == inputs["q"].shape and out.dtype == inputs["q"].dtype
        assert (out.double() - want).abs().max().item() < 1e-2, name


# ---- the seed, in a child with the interpreter ----------------------------------------
SEED_CASES = [
    # the problem's CPU shapes, default knobs
    *({"cfg": c, "dtype": d} for c in ("cpu", "cpu_domain") for d in ("float16", "bfloat16")),
    # small tiles: several query and key tiles, so the three loop stages and the tile skipping
    # run (a 20-wide window over 100 keys visits 2 of 4 key tiles per query tile)
    *({"cfg": _cfg(1, 4, 2, 100, 64, window=20, sinks=True), "dtype": d,
       "knobs": {"BLOCK_M_D64": "32", "BLOCK_N_D64": "32"}} for d in ("float16", "bfloat16")),
    {"cfg": _cfg(2, 2, 1, 100, 64, softcap=1.0), "dtype": "float16",
     "knobs": {"BLOCK_M_D64": "32", "BLOCK_N_D64": "32", "SPLIT_MASK": "False",
               "HEAVY_FIRST": "False"}},
    {"cfg": _cfg(1, 2, 1, 70, 256, window=17, softcap=2.0), "dtype": "bfloat16",
     "knobs": {"BLOCK_M_D256": "32", "BLOCK_N_D256": "16"}},
    {"cfg": _cfg(1, 3, 3, 90, 128, window=33, softcap=5.0, sinks=True), "dtype": "float16",
     "knobs": {"BLOCK_M_D128": "32", "BLOCK_N_D128": "32"}},
]
# (q shape, k/v shape, dtype): head dim 96, float32, H % Hkv != 0
REFUSED = [((1, 2, 16, 96), (1, 1, 16, 96), "float16"), ((1, 2, 16, 64), (1, 1, 16, 64), "float32"),
           ((1, 6, 16, 64), (1, 4, 16, 64), "float16")]


def child(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs the seed (knobs set as the mutator sets them) on each case; returns its error and
    the problem's bound (factor x the flash-rounded probe's error + floor)."""
    import importlib.util

    import torch
    from evoattn.contract.knobs import set_knobs
    from evoattn.problems import get_problem
    problem = get_problem("model")
    results = []
    for n, case in enumerate(cases):
        text = set_knobs(SEED.read_text(), case.get("knobs", {}))
        folder = Path(tempfile.mkdtemp())
        path = folder / f"seed_{n}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"seed_{n}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        named = {"cpu": problem.cpu_configs, "cpu_domain": problem.cpu_domain_configs}
        cfgs = named[case["cfg"]] if isinstance(case["cfg"], str) else (case["cfg"],)
        for cfg in cfgs:
            results.append(_run_one(problem, module, cfg, case["dtype"], torch))
    for q_shape, kv_shape, dtype in REFUSED:
        q, k, v = (torch.randn(s).to(getattr(torch, dtype)) for s in (q_shape, kv_shape, kv_shape))
        try:
            module.attention(q, k, v)
            results.append({"shape": q_shape, "refused": False})
        except ValueError as e:
            results.append({"shape": q_shape, "refused": True, "why": str(e)})
    return results


def _run_one(problem: Any, module: Any, cfg: dict[str, Any], dtype: str, torch: Any) -> dict:
    inputs = problem.make_inputs(cfg, getattr(torch, dtype), torch.device("cpu"),
                                 torch.Generator().manual_seed(7))
    before = {n: t.clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    ref = problem.reference(inputs, cfg)
    probe = (problem.torch_in_dtype(inputs, cfg).float() - ref).abs().max().item()
    out = problem.call(module.attention, inputs, cfg)
    err = (out.float() - ref).abs().max().item()
    return {"cfg": cfg, "dtype": dtype, "err": err, "bound": problem.tolerance.bound(probe),
            "same_dtype": out.dtype == inputs["q"].dtype and out.shape == inputs["q"].shape,
            "inputs_kept": all(torch.equal(before[n], inputs[n]) for n in before)}


@pytest.fixture(scope="module")
def seed_results() -> list[dict[str, Any]]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, __file__, json.dumps(SEED_CASES)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_seed_passes_the_problems_tolerance_in_both_dtypes(seed_results: list[dict]) -> None:
    checked = [r for r in seed_results if "err" in r]
    assert {r["dtype"] for r in checked} == {"float16", "bfloat16"}
    for r in checked:
        assert r["same_dtype"] and r["inputs_kept"], r
        assert math.isfinite(r["err"]) and r["err"] <= r["bound"], r


def test_seed_refuses_shapes_outside_the_contract(seed_results: list[dict]) -> None:
    refused = [r for r in seed_results if "refused" in r]
    assert len(refused) == len(REFUSED) and all(r["refused"] for r in refused), refused


# ---- `evoattn eval` on the CPU --------------------------------------------------------
def test_eval_reports_the_seed_correct_and_times_only_the_baselines_that_apply(
        tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    configs = ("B=1,H=4,Hkv=2,S=64,D=64,window=16,softcap=0.0,sinks=false;"
               "B=1,H=2,Hkv=1,S=64,D=256,window=0,softcap=5.0,sinks=true")
    p = subprocess.run([sys.executable, "-m", "evoattn.cli", "eval", str(SEED), "--problem",
                        "model", "--device", "cpu", "--configs", configs, "--trials", "1",
                        "--reps", "2", "--json", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Correctness: PASS" in p.stdout
    data = json.loads(out.read_text())
    assert data["correct"] is True
    timed = [set(c["baselines"]) for c in data["configs"] if c["baselines"]]
    assert timed == [{"eager", "flex_attention", "sdpa"}, {"eager", "flex_attention"}]


def test_a_config_outside_the_contract_is_a_one_line_usage_error() -> None:
    p = subprocess.run([sys.executable, "-m", "evoattn.cli", "eval", str(SEED), "--problem",
                        "model", "--device", "cpu", "--configs",
                        "B=1,H=3,Hkv=2,S=8,D=64,window=0,softcap=0.0,sinks=false"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 4 and "H is outside the contract" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
