"""The `model_decode` problem (Gemma 2 / GPT-OSS generation over a KV cache) and its Triton seed.

The contract's edges are checked against a naive float64 loop written here (keys listed one
by one per new token); the seed runs in a child process (this file as a script) with
TRITON_INTERPRET=1 set before Triton is imported, as tests/test_seeds_triton.py explains;
`evoattn eval` runs end to end on the CPU.
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
SEED = ROOT / "seeds" / "model" / "model_decode_triton.py"


def _cfg(b: int, h: int, hkv: int, t: int, ctx: int, d: int = 64, window: int = 0,
         softcap: float = 0.0, sinks: bool = False, lens: str = "ragged") -> dict[str, Any]:
    return {"B": b, "H": h, "Hkv": hkv, "T": t, "ctx": ctx, "D": d, "window": window,
            "softcap": softcap, "sinks": sinks, "lens": lens}


# ---- an independent float64 answer ----------------------------------------------------
def naive(inputs: dict[str, Any]) -> Any:
    """Returns the contract's answer row by row in float64: new token t of a length-L
    sequence at p = L - T + t sees keys j with max(0, p - W + 1) <= j <= p; none: zeros."""
    import torch
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    W, cap, sinks, scale = inputs["window"], inputs["softcap"], inputs["sinks"], inputs["scale"]
    B, H, T, D = q.shape
    G = H // k.shape[1]
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b, L in enumerate(inputs["cache_seqlens"].tolist()):
        for h in range(H):
            for t in range(T):
                p = L - T + t
                keys = [j for j in range(L) if j <= p and (W == 0 or p - W < j)]
                if not keys:
                    continue
                kk, vv = k[b, h // G, keys].double(), v[b, h // G, keys].double()
                s = kk @ q[b, h, t].double() * scale
                if cap:
                    s = cap * torch.tanh(s / cap)
                w = torch.exp(s)
                den = w.sum() + (math.exp(float(sinks[h])) if sinks is not None else 0.0)
                out[b, h, t] = (w[:, None] * vv).sum(0) / den
    return out


def _problem() -> Any:
    from evoattn.problems import get_problem
    return get_problem("model_decode")


def _inputs(cfg: dict[str, Any], dtype: str = "float16", seed: int = 0) -> dict[str, Any]:
    import torch
    return _problem().make_inputs(cfg, getattr(torch, dtype), torch.device("cpu"),
                                  torch.Generator().manual_seed(seed))


def _label(cfg: dict[str, Any]) -> str:
    return _problem().label(cfg)


EDGE_CASES = [
    _cfg(7, 2, 1, 3, 30, window=1, lens="edge"),          # a row sees itself only
    _cfg(3, 4, 2, 4, 40, window=6),                       # the window's lower edge moves per t
    _cfg(3, 2, 1, 2, 30, window=100),                     # larger than every length
    _cfg(7, 4, 2, 16, 40, lens="edge"),                   # T > 1, lengths 0, 1, T - 1, T, ...
    _cfg(2, 6, 2, 1, 50, 128, softcap=0.7),               # an active cap, GQA 3:1
    _cfg(7, 4, 1, 3, 25, window=2, sinks=True, lens="edge"),   # multi-query, sinks
    _cfg(2, 4, 2, 5, 33, 256, window=7, softcap=1.5, sinks=True),
]


@pytest.mark.parametrize("cfg", EDGE_CASES, ids=_label)
def test_reference_matches_a_naive_float64_loop(cfg: dict[str, Any]) -> None:
    inputs = _inputs(cfg)
    ref = _problem().reference(inputs, cfg)
    assert ref.dtype.is_floating_point and ref.shape == inputs["q"].shape
    assert (ref.double() - naive(inputs)).abs().max().item() < 1e-5


def test_rows_that_see_no_key_are_zero_even_with_a_sink() -> None:
    cfg = _cfg(7, 2, 1, 3, 30, window=1, sinks=True, lens="edge")     # lengths 0, 1, 2, ...
    ref = _problem().reference(_inputs(cfg), cfg)
    assert bool((ref[0] == 0).all())                                   # length 0
    assert bool((ref[1, :, :2] == 0).all()) and bool((ref[1, :, 2] != 0).any())


def test_a_dominant_sink_takes_almost_all_of_a_row() -> None:
    from evoattn.problems.model_prefill import DOMINANT_SINK
    cfg = _cfg(2, 4, 2, 2, 30, window=1, sinks=True, lens="full")
    inputs = _inputs(cfg)
    assert float(inputs["sinks"][0]) == DOMINANT_SINK
    ref = _problem().reference(inputs, cfg)
    assert (ref.double() - naive(inputs)).abs().max().item() < 1e-5
    v = inputs["v"][:, :, :30].float()
    assert ref[:, 0].abs().max() < 0.01 * v.abs().max()
    assert ref[:, 1:].abs().max() > 0.1 * v.abs().max()


def test_the_reference_never_reads_past_a_length() -> None:
    cfg = _cfg(3, 4, 2, 4, 64, window=9, softcap=2.0, sinks=True)
    inputs = _inputs(cfg)
    ref = _problem().reference(inputs, cfg)
    for b, n in enumerate(inputs["cache_seqlens"].tolist()):
        inputs["k"][b, :, n:] = 1e4
        inputs["v"][b, :, n:] = float("nan")
    import torch
    assert torch.equal(_problem().reference(inputs, cfg), ref)


def test_lengths_are_the_decode_problems() -> None:
    from evoattn.problems.decode import lengths as decode_lengths
    from evoattn.problems.model_decode import lengths
    for pattern in ("ragged", "full", "edge"):
        cfg = _cfg(9, 4, 2, 3, 100, lens=pattern)
        want = decode_lengths({"B": 9, "Hq": 4, "Hkv": 2, "Sq": 3, "ctx": 100, "D": 64,
                               "lens": pattern})
        assert lengths(cfg) == want
        assert _inputs(cfg)["cache_seqlens"].tolist() == want


def test_flops_and_bytes_count_the_visible_keys() -> None:
    from evoattn.problems.model_decode import lengths
    cfg = _cfg(7, 4, 2, 3, 100, window=5, lens="edge")
    lens = lengths(cfg)
    pairs = sum(sum(1 for j in range(L) if L - 3 + t - 5 < j <= L - 3 + t)
                for L in lens for t in range(3))
    assert _problem().flops(cfg) == 4.0 * 4 * 64 * pairs
    keys = sum(min(L, 5 + 3 - 1) for L in lens)
    assert _problem().bytes_moved(cfg) == (2 * keys * 2 * 64 + 2 * 7 * 4 * 3 * 64) * 2 + 4 * 7


@pytest.mark.parametrize("change, key", [
    ({"D": 96}, "D"), ({"H": 6, "Hkv": 4}, "H"), ({"window": -1}, "window"),
    ({"softcap": -2.0}, "softcap"), ({"T": 17}, "T"), ({"Sq": 1}, "Sq"), ({"ctx": 0}, "ctx"),
    ({"lens": "odd"}, "lens"),
])
def test_configs_outside_the_contract_name_their_key(change: dict[str, Any], key: str) -> None:
    from evoattn.problems.model_decode import shape_of
    with pytest.raises(ValueError, match=key):
        shape_of({**_cfg(1, 4, 2, 1, 16), **change})


def test_default_configs_are_the_models_decode_shapes() -> None:
    from evoattn.problems.model_decode import shape_of
    shapes = [shape_of(c) for c in _problem().default_configs]
    gemma = [s for s in shapes if s.D == 256]
    oss = [s for s in shapes if s.sinks]
    assert len(gemma) + len(oss) == len(shapes)
    assert all((s.H, s.Hkv, s.softcap, s.window in (0, 4096)) == (8, 4, 50.0, True)
               for s in gemma)
    assert all((s.H, s.Hkv, s.D, s.window in (0, 128)) == (64, 8, 64, True) for s in oss)
    for family in (gemma, oss):
        assert {s.window > 0 for s in family} == {True, False}
        assert {s.T for s in family} == {1, 4, 16}
    assert {s.B for s in shapes} <= set(range(1, 17)) and {1, 16} <= {s.B for s in shapes}
    assert min(s.ctx for s in shapes) >= 1024 and max(s.ctx for s in shapes) == 16 * 1024
    caches = [4 * s.B * s.Hkv * s.ctx * s.D for s in shapes]         # k and v, in 16 bits
    assert max(caches) <= 2 ** 30 and 3 * sum(caches) < 16 * 2 ** 30


@pytest.mark.parametrize("cfg, sdpa_runs", [
    (_cfg(3, 4, 2, 1, 40, window=7), True),
    (_cfg(2, 4, 2, 1, 40, lens="full"), True),            # SDPA without a mask
    (_cfg(2, 4, 1, 4, 40), True),
    (_cfg(2, 2, 1, 2, 40, 256, window=9, softcap=2.0), False),
    (_cfg(3, 4, 2, 3, 40, window=7, sinks=True), False),
])
def test_baselines_compute_the_contract(cfg: dict[str, Any], sdpa_runs: bool) -> None:
    from evoattn.child.measure import applies
    inputs = _inputs(cfg)
    want = naive(inputs)
    timed = {n: f for n, f in _problem().baselines().items() if applies(f, cfg)}
    assert ("sdpa" in timed) == sdpa_runs
    assert {"eager", "flex_attention"} <= set(timed)
    for name, fn in timed.items():
        out = fn(inputs, cfg)
        assert out.shape == inputs["q"].shape and out.dtype == inputs["q"].dtype
        assert (out.double() - want).abs().max().item() < 1e-2, name


def test_baselines_build_the_steps_masks_once_per_config(monkeypatch: Any) -> None:
    import evoattn.problems.model_decode_baselines as mdb
    built: list[int] = []
    keep = mdb._keep
    monkeypatch.setattr(mdb, "_keep", lambda inputs: built.append(1) or keep(inputs))
    cfg = _cfg(3, 4, 2, 2, 40, window=7)
    problem = _problem()
    inputs = _inputs(cfg)
    for _ in range(3):
        problem.baselines()["eager"](inputs, cfg)
        problem.baselines()["sdpa"](inputs, cfg)
    assert len(built) == 2                      # eager's additive mask and SDPA's boolean one


def test_flash_kvcache_is_named_as_skipped_when_flash_attn_is_absent() -> None:
    problem = _problem()
    assert set(problem.baselines()) | set(problem.skipped_baselines()) == \
        set(problem.baseline_names)
    if "flash_kvcache" in problem.skipped_baselines():
        assert "flash-attn" in problem.skipped_baselines()["flash_kvcache"]


# ---- the seed, in a child with the interpreter ----------------------------------------
SMALL = {"MIN_CHUNK_KEYS": "128", "PROGRAMS_PER_SM": "8"}      # many chunks over a short cache
SEED_CASES = [
    # the problem's CPU shapes, default knobs
    *({"cfg": c, "dtype": d} for c in ("cpu", "cpu_domain") for d in ("float16", "bfloat16")),
    # several chunks, several row blocks, sinks merged after the chunks; both dtypes
    *({"cfg": _cfg(3, 8, 2, 5, 600, sinks=True), "dtype": d,
       "knobs": {**SMALL, "BLOCK_N_D64": "32", "MAX_BLOCK_M": "16"}}
      for d in ("float16", "bfloat16")),
    # a window over a long cache: chunks start at the window; edge lengths; one stage
    {"cfg": _cfg(7, 4, 2, 4, 700, window=150, softcap=3.0, lens="edge"), "dtype": "float16",
     "knobs": {**SMALL, "BLOCK_N_D64": "16", "SPLIT_MASK": "False"}},
    {"cfg": _cfg(2, 2, 1, 16, 500, 256, window=300, softcap=2.0, sinks=True),
     "dtype": "bfloat16", "knobs": {**SMALL, "BLOCK_N_D256": "16"}},
    {"cfg": _cfg(3, 3, 3, 2, 400, 128, softcap=5.0, sinks=True, lens="full"),
     "dtype": "float16", "knobs": {**SMALL, "BLOCK_N_D128": "32"}},
    # a 128-window over a 3000-key cache: the keys before the window's first block are NaN,
    # so a kernel that reads them (or a chunk of them) fails
    {"cfg": _cfg(2, 4, 2, 2, 3000, window=128, sinks=True, lens="full"), "dtype": "float16",
     "knobs": {"BLOCK_N_D64": "16"}, "poison_before": 16},
]
# (q shape, k/v shape, dtype): head dim 96, float32, H % Hkv != 0, 17 new tokens
REFUSED = [((1, 2, 1, 96), (1, 1, 16, 96), "float16"), ((1, 2, 1, 64), (1, 1, 16, 64), "float32"),
           ((1, 6, 1, 64), (1, 4, 16, 64), "float16"), ((1, 2, 17, 64), (1, 1, 32, 64), "float16")]


def child(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs the seed (knobs set as the mutator sets them) on each case; returns its error and
    the problem's bound (factor x the flash-rounded probe's error + floor)."""
    import importlib.util

    import torch
    from evoattn.contract.knobs import set_knobs
    problem = _problem()
    results = []
    for n, case in enumerate(cases):
        text = set_knobs(SEED.read_text(), case.get("knobs", {}))
        path = Path(tempfile.mkdtemp()) / f"seed_{n}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"seed_{n}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        named = {"cpu": problem.cpu_configs, "cpu_domain": problem.cpu_domain_configs}
        cfgs = named[case["cfg"]] if isinstance(case["cfg"], str) else (case["cfg"],)
        for cfg in cfgs:
            results.append(_run_one(problem, module, cfg, case["dtype"], torch,
                                    case.get("poison_before", 0)))
    for q_shape, kv_shape, dtype in REFUSED:
        q, k, v = (torch.randn(s).to(getattr(torch, dtype)) for s in (q_shape, kv_shape, kv_shape))
        lens = torch.full((q_shape[0],), kv_shape[2], dtype=torch.int32)
        try:
            module.attention(q, k, v, lens)
            results.append({"shape": q_shape, "refused": False})
        except ValueError as e:
            results.append({"shape": q_shape, "refused": True, "why": str(e)})
    return results


def _run_one(problem: Any, module: Any, cfg: dict[str, Any], dtype: str, torch: Any,
             poison_before: int) -> dict:
    """With poison_before (a block size), the cache before each sequence's window, rounded
    down to that block, is set to NaN after the reference is computed."""
    inputs = problem.make_inputs(cfg, getattr(torch, dtype), torch.device("cpu"),
                                 torch.Generator().manual_seed(7))
    ref = problem.reference(inputs, cfg)
    probe = (problem.torch_in_dtype(inputs, cfg).float() - ref).abs().max().item()
    if poison_before:
        T, W = cfg["T"], cfg["window"]
        for b, L in enumerate(inputs["cache_seqlens"].tolist()):
            first = max(L - T - W + 1, 0) // poison_before * poison_before
            inputs["k"][b, :, :first] = float("nan")
            inputs["v"][b, :, :first] = float("nan")
    before = {n: t.clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    out = problem.call(module.attention, inputs, cfg)
    err = (out.float() - ref).abs().max().item()
    return {"cfg": cfg, "dtype": dtype, "err": err, "bound": problem.tolerance.bound(probe),
            "same_dtype": out.dtype == inputs["q"].dtype and out.shape == inputs["q"].shape,
            "inputs_kept": all(torch.equal(before[n].nan_to_num(), inputs[n].nan_to_num())
                               for n in before)}


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
    configs = ("B=2,H=4,Hkv=2,T=1,ctx=64,D=64,window=16,softcap=0.0,sinks=false;"
               "B=2,H=2,Hkv=1,T=4,ctx=64,D=256,window=0,softcap=5.0,sinks=true")
    p = subprocess.run([sys.executable, "-m", "evoattn.cli", "eval", str(SEED), "--problem",
                        "model_decode", "--device", "cpu", "--configs", configs, "--trials",
                        "1", "--reps", "2", "--json", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Correctness: PASS" in p.stdout
    data = json.loads(out.read_text())
    assert data["correct"] is True
    timed = [set(c["baselines"]) for c in data["configs"] if c["baselines"]]
    assert timed == [{"eager", "flex_attention", "sdpa"}, {"eager", "flex_attention"}]


def test_a_config_outside_the_contract_is_a_one_line_usage_error() -> None:
    p = subprocess.run([sys.executable, "-m", "evoattn.cli", "eval", str(SEED), "--problem",
                        "model_decode", "--device", "cpu", "--configs",
                        "B=1,H=4,Hkv=2,T=17,ctx=8,D=64,window=0,softcap=0.0,sinks=false"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 4 and "T is outside the contract" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
