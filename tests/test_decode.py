"""The `decode` problem and its split-KV seed, on the CPU.

The problem's semantics are checked against an independent float64 brute force (dense
attention over the whole cache with an explicit mask): ragged lengths with 0 and 1, Sq > 1
causal among the new tokens, GQA, zeros for queries that see no key. The seed runs in a child
process with TRITON_INTERPRET=1 (see test_seeds_triton.py for why), under knob settings that
force many splits and several row blocks, and once through the real `evoattn eval`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from evoattn.problems import get_problem
from evoattn.problems.decode import GARBAGE_SCALE, lengths, shape_of

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "seeds" / "decode" / "decode_triton.py"
CPU = torch.device("cpu")


def cfg(b: int, hq: int, hkv: int, sq: int, ctx: int, d: int = 64, lens: str = "ragged") -> dict:
    return {"B": b, "Hq": hq, "Hkv": hkv, "Sq": sq, "ctx": ctx, "D": d, "lens": lens}


def inputs_for(c: dict, dtype: torch.dtype = torch.float16, seed: int = 0) -> dict:
    return get_problem("decode").make_inputs(c, dtype, CPU, torch.Generator().manual_seed(seed))


def brute_force(inp: dict) -> torch.Tensor:
    """Dense float64 attention over the whole cache: query i of sequence b sees key j iff
    j <= L_b - Sq + i; a row with no visible key is zero."""
    q, k, v = (inp[n].double() for n in ("q", "k", "v"))
    lens = inp["cache_seqlens"].long()
    B, Hq, Sq, D = q.shape
    G = Hq // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    j = torch.arange(k.shape[2])
    keep = j[None, None, :] <= (lens[:, None, None] - Sq + torch.arange(Sq)[None, :, None])
    s = (q @ k.transpose(-1, -2) * inp["scale"]).masked_fill(~keep[:, None], float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


# ---- configs and lengths ------------------------------------------------------------------------
def test_lengths_are_deterministic_and_cover_the_edges() -> None:
    c = cfg(8, 4, 2, 3, 100, lens="edge")
    assert lengths(c) == lengths(dict(c))
    assert lengths(c)[:7] == [0, 1, 2, 3, 100, 99, 50]
    assert all(0 <= n <= 100 for n in lengths(c))
    ragged = lengths(cfg(64, 32, 8, 1, 8192))
    assert ragged[0] == 8192 and all(4096 <= n <= 8192 for n in ragged)
    assert len(set(ragged)) > 32                           # really ragged
    assert lengths(cfg(3, 4, 2, 1, 50, lens="full")) == [50, 50, 50]


@pytest.mark.parametrize("bad, key", [({"Sq": 17}, "Sq"), ({"Hkv": 3}, "Hq % Hkv"),
                                      ({"D": 96}, "D"), ({"lens": "odd"}, "lens")])
def test_bad_configs_name_what_is_wrong(bad: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        shape_of({**cfg(2, 4, 2, 1, 64), **bad})
    with pytest.raises(ValueError, match="ctx"):
        shape_of({k: v for k, v in cfg(2, 4, 2, 1, 64).items() if k != "ctx"})


def test_default_configs_cover_the_issue_grid_within_memory() -> None:
    p = get_problem("decode")
    shapes = [shape_of(c) for c in p.default_configs]
    assert {s.B for s in shapes} >= {1, 8, 64}
    assert {s.ctx for s in shapes} == {1024, 8192, 32768}
    assert {(s.Hq, s.Hkv) for s in shapes} == {(32, 8), (8, 1)}
    assert {s.Sq for s in shapes} == {1, 4} and {s.D for s in shapes} == {64, 128}
    # unpadded generation steps (what transformers hands the package) as well as padded ones
    assert {s.lens for s in shapes} == {"ragged", "full"}
    caches = [4 * s.B * s.Hkv * s.ctx * s.D for s in shapes]     # k and v, in 16-bit
    assert max(caches) <= 2 ** 30 and 3 * sum(caches) < 16 * 2 ** 30  # 3 trials held at once


def test_flops_and_bytes_count_only_the_valid_cache() -> None:
    p = get_problem("decode")
    c = cfg(2, 4, 2, 2, 10, lens="edge")                 # lengths 0 and 1
    assert lengths(c) == [0, 1]
    # length 1, Sq 2: query 0 sees no key, query 1 sees key 0
    assert p.flops(c) == 4.0 * 4 * 64 * 1
    assert p.bytes_moved(c) == (2 * 1 * 2 * 64 + 2 * 2 * 4 * 2 * 64) * 2 + 4 * 2
    big = cfg(16, 32, 8, 1, 8192)
    assert p.bytes_moved(big, 2) == pytest.approx(2 * sum(lengths(big)) * 8 * 64 * 2, rel=1e-3)


# ---- the inputs ---------------------------------------------------------------------------------
def test_the_cache_past_each_length_is_large_finite_garbage_refilled_in_place() -> None:
    p = get_problem("decode")
    c = cfg(4, 4, 2, 1, 256)
    inp = inputs_for(c)
    lens = lengths(c)
    ptrs = {n: inp[n].data_ptr() for n in ("q", "k", "v")}
    for attempt in range(2):
        for name in ("k", "v"):
            t = inp[name].float()
            assert bool(torch.isfinite(t).all())
            valid = torch.cat([t[b, :, :n].flatten() for b, n in enumerate(lens)])
            tail = torch.cat([t[b, :, n:].flatten() for b, n in enumerate(lens)])
            assert 0.8 < valid.std() < 1.2
            assert 0.8 * GARBAGE_SCALE < tail.std() < 1.2 * GARBAGE_SCALE
        before = inp["k"].clone()
        p.refill(inp, torch.Generator().manual_seed(attempt + 1))
        assert not torch.equal(before, inp["k"])
    assert {n: inp[n].data_ptr() for n in ("q", "k", "v")} == ptrs


def test_the_reference_never_reads_past_a_length() -> None:
    p = get_problem("decode")
    c = cfg(3, 4, 2, 4, 64)
    inp = inputs_for(c)
    ref = p.reference(inp, c)
    for b, n in enumerate(lengths(c)):
        inp["k"][b, :, n:] = 1e4
        inp["v"][b, :, n:] = float("nan")
    assert torch.equal(p.reference(inp, c), ref)


# ---- the semantics ------------------------------------------------------------------------------
SEMANTIC = [cfg(7, 4, 2, 3, 40, lens="edge"), cfg(3, 8, 1, 4, 50), cfg(2, 6, 2, 16, 30),
            cfg(5, 2, 2, 1, 20, 128, lens="edge"), cfg(1, 2, 1, 1, 1)]


@pytest.mark.parametrize("c", SEMANTIC, ids=lambda c: get_problem("decode").label(c))
def test_reference_matches_dense_masked_attention(c: dict) -> None:
    inp = inputs_for(c)
    ref = get_problem("decode").reference(inp, c)
    assert ref.dtype == torch.float32 and ref.shape == inp["q"].shape
    assert (ref.double() - brute_force(inp)).abs().max().item() < 1e-5


def test_queries_that_see_no_key_output_zeros() -> None:
    c = cfg(7, 4, 2, 3, 40, lens="edge")                 # lengths 0, 1, 2, 3, ...
    ref = get_problem("decode").reference(inputs_for(c), c)
    assert bool((ref[0] == 0).all())                     # length 0
    assert bool((ref[1, :, :2] == 0).all()) and bool((ref[1, :, 2] != 0).any())   # length 1
    assert bool((ref[2, :, :1] == 0).all()) and bool((ref[2, :, 1:] != 0).all())  # length 2


def test_new_tokens_are_causal_among_themselves() -> None:
    """Query i of Sq sits at L - Sq + i: the key of the next new token changes the later
    queries' outputs and not the earlier ones'."""
    p = get_problem("decode")
    c = cfg(1, 2, 1, 4, 32, lens="full")                 # L = 32: queries at 28..31
    inp = inputs_for(c)
    ref = p.reference(inp, c)
    inp["k"][0, :, 30] += 3.0                            # the key of query 2 (position 30)
    inp["v"][0, :, 30] -= 5.0
    new = p.reference(inp, c)
    assert torch.equal(new[:, :, :2], ref[:, :, :2])
    assert (new[:, :, 2:] - ref[:, :, 2:]).abs().min() > 0


def test_gqa_query_heads_share_their_key_value_head() -> None:
    """Query heads 0..3 read key/value head 0 and 4..7 head 1: changing head 1 changes only
    the second group."""
    p = get_problem("decode")
    c = cfg(2, 8, 2, 1, 16, lens="full")
    inp = inputs_for(c)
    ref = p.reference(inp, c)
    inp["v"][:, 1] += 1.0
    new = p.reference(inp, c)
    assert torch.equal(new[:, :4], ref[:, :4])
    assert torch.allclose(new[:, 4:], ref[:, 4:] + 1.0, atol=2e-3)     # v + 1 rounded to fp16


def test_torch_in_dtype_is_a_small_nonzero_error_in_each_dtype() -> None:
    p = get_problem("decode")
    c = cfg(3, 4, 2, 2, 64)
    for dtype, most in ((torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        inp = inputs_for(c, dtype)
        probe = p.torch_in_dtype(inp, c)
        err = (probe.float() - p.reference(inp, c)).abs().max().item()
        assert probe.dtype == dtype and 0 < err < most


# ---- the baselines ------------------------------------------------------------------------------
@pytest.mark.parametrize("c", [cfg(3, 4, 2, 1, 64), cfg(2, 4, 1, 4, 48),
                               cfg(2, 4, 2, 1, 32, lens="full")],
                         ids=["ragged-q1", "ragged-q4", "uniform-q1"])
def test_sdpa_baselines_are_right(c: dict) -> None:
    p = get_problem("decode")
    inp = inputs_for(c)
    want = brute_force(inp)
    for fn in (p.baseline, p.extra_baselines()["sdpa_gqa_mask"], p.extra_baselines()["naive"]):
        out = fn(inp, c)
        assert out.shape == inp["q"].shape
        assert (out.double() - want).abs().max().item() < 2e-3


@pytest.mark.parametrize("c, how", [(cfg(2, 4, 2, 1, 32, lens="full"), "enable_gqa"),
                                    (cfg(3, 4, 2, 1, 64), "packed"),
                                    (cfg(2, 4, 1, 4, 48), "repeated")])
def test_sdpa_hf_handles_gqa_as_transformers_does(c: dict, how: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """No mask: enable_gqa; one new token with a padding mask: the query heads packed as rows
    of their key/value head; several new tokens with a mask: k and v repeated per query head."""
    p = get_problem("decode")
    inp = inputs_for(c)
    p.baseline(inp, c)                                  # builds the step's mask once
    seen: list = []
    original = F.scaled_dot_product_attention

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    p.baseline(inp, c)
    (q, k, _), kw = seen[-1]
    B, Hq, Sq, D = inp["q"].shape
    Hkv = inp["k"].shape[1]
    if how == "enable_gqa":
        assert kw.get("enable_gqa") is True and kw["attn_mask"] is None
    elif how == "packed":
        assert q.shape == (B, Hkv, Hq // Hkv, D) and k.shape[1] == Hkv
        assert kw["attn_mask"].shape == (B, 1, 1, max(lengths(c)))
    else:
        assert k.shape[1] == Hq and "enable_gqa" not in kw
        assert kw["attn_mask"].shape == (B, 1, Sq, max(lengths(c)))


def test_flash_attn_baseline_is_named_as_skipped_when_absent() -> None:
    p = get_problem("decode")
    assert "flash_kvcache" in p.baseline_names
    try:
        import flash_attn  # noqa: F401
        present = True
    except ImportError:
        present = False
    if present:
        assert "flash_kvcache" in p.baselines() and p.skipped_baselines() == {}
    else:
        assert set(p.baselines()) == {"sdpa_hf", "flex"}
        assert "flash-attn is not importable" in p.skipped_baselines()["flash_kvcache"]


@pytest.mark.slow
def test_flex_baseline_is_right_on_ragged_lengths() -> None:
    p = get_problem("decode")
    c = cfg(3, 4, 2, 2, 100)
    inp = inputs_for(c)
    out = p.baselines()["flex"](inp, c)
    assert (out.double() - brute_force(inp)).abs().max().item() < 2e-3


# ---- the seed, in Triton's interpreter (a child process) ----------------------------------------
FORCE_SPLITS = {"PROGRAMS_PER_SM": "8", "MIN_SPLIT_KEYS": "64", "BLOCK_N_D64": "16",
                "BLOCK_N_D128": "32"}
# the fused merge in two levels (groups of 2 splits, then the groups) from 3 splits up
MERGE_TREE = {**FORCE_SPLITS, "MERGE_GROUP": "2", "MERGE_TREE_AT": "3"}
ROW_BLOCKS = {"MAX_BLOCK_M": "16", "PROGRAMS_PER_SM": "4", "MIN_SPLIT_KEYS": "64",
              "BLOCK_N_D64": "32"}
MERGE_KERNEL = {**FORCE_SPLITS, "FUSED_MERGE": "False"}     # the separate merge kernel
SEED_CONFIGS = [cfg(3, 4, 2, 1, 200), cfg(2, 4, 1, 4, 130), cfg(7, 2, 2, 3, 77, 128, "edge"),
                cfg(5, 6, 2, 16, 40, 64, "edge"), cfg(1, 2, 1, 1, 1), cfg(1, 8, 1, 4, 300),
                cfg(9, 2, 1, 1, 70, 64, "edge")]
NO_CAUSAL = ("lim = L - SQ + rows % SQ", "lim = L - 1 + rows * 0")
NO_TICKET_RESET = ("tl.atomic_xchg(tickets, 0)  # ready", "pass  # ready")
NO_GROUP_TICKET_RESET = ("tl.atomic_xchg(tickets + 1 + g, 0)", "pass")
NO_MERGE_WEIGHTS = ("w = tl.math.exp2(lse - m_sub)", "w = tl.where(lse == float('-inf'), 0.0, 1.0)")


def child(cases_path: str, out_path: str) -> None:
    import importlib.util
    sys.path.insert(0, str(ROOT))
    from evoattn.mutators.knobs import set_knobs
    p = get_problem("decode")
    results = []
    for i, (knobs, c, dtype, mutation) in enumerate(json.loads(Path(cases_path).read_text())):
        text = set_knobs(SEED.read_text(), knobs)
        if mutation:
            assert text.count(mutation[0]) == 1, mutation[0]
            text = text.replace(*mutation)
        path = Path(out_path).parent / f"seed_{i}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"seed_{i}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        inp = inputs_for(c, getattr(torch, dtype), seed=i)
        before = {n: t.clone() for n, t in inp.items() if isinstance(t, torch.Tensor)}
        # twice, on other values the second time: a fused merge's tickets must be left ready
        # for the next call (a stale output of the first call would fail the second check)
        checks = []
        for j in range(2):
            if j:
                p.refill(inp, torch.Generator().manual_seed(1000 + i))
            out = p.call(mod.attention, inp, c)
            if j == 0:
                unchanged = all(torch.equal(t, inp[n]) for n, t in before.items())
            ref = p.reference(inp, c)
            torch_err = (p.torch_in_dtype(inp, c).float() - ref).abs().max().item()
            checks.append({"err": (out.float() - ref).abs().max().item(), "torch_err": torch_err,
                           "bound": 2 * torch_err + 1e-5, "ok_shape": out.shape ==
                           inp["q"].shape and out.dtype == inp["q"].dtype})
        worst = max(checks, key=lambda r: (not r["ok_shape"], not r["err"] <= r["bound"]))
        results.append({**worst, "unchanged": unchanged,
                        "splits": mod._splits(c["B"] * c["Hkv"], c["ctx"], 16, CPU)[0]})
    Path(out_path).write_text(json.dumps(results))


def run(cases: list) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, out_path = Path(tmp, "cases.json"), Path(tmp, "out.json")
        cases_path.write_text(json.dumps(cases))
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, __file__, str(cases_path), str(out_path)],
                              env=env, capture_output=True, text=True, timeout=550)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(out_path.read_text())


def ok(r: dict) -> bool:
    return r["ok_shape"] and r["unchanged"] and r["err"] <= r["bound"]


@pytest.mark.slow
def test_seed_is_right_with_splits_row_blocks_and_both_dtypes() -> None:
    cases = [(k, c, dt, None) for k in ({}, FORCE_SPLITS, MERGE_TREE, ROW_BLOCKS, MERGE_KERNEL)
             for c in SEED_CONFIGS for dt in ("float16", "bfloat16")]
    results = run(cases)
    bad = [(c, r) for c, r in zip(cases, results) if not ok(r)]
    assert not bad, bad
    assert max(r["splits"] for r in results) >= 4        # the merge really ran


@pytest.mark.slow
def test_the_seed_checks_catch_a_missing_causal_mask_and_a_bad_merge() -> None:
    sq1, sq4 = cfg(3, 4, 2, 1, 200), cfg(2, 4, 1, 4, 130)
    cases = [({}, sq1, "float16", NO_CAUSAL), ({}, sq4, "float16", NO_CAUSAL),
             (FORCE_SPLITS, sq1, "float16", NO_MERGE_WEIGHTS),
             (MERGE_KERNEL, sq1, "float16", NO_MERGE_WEIGHTS),
             (FORCE_SPLITS, sq1, "float16", NO_TICKET_RESET),
             (MERGE_TREE, sq1, "float16", NO_GROUP_TICKET_RESET),
             (MERGE_TREE, sq1, "float16", NO_MERGE_WEIGHTS)]
    r = run(cases)
    assert ok(r[0])               # one new token: there is nothing to be causal about
    assert not ok(r[1]) and not ok(r[2]) and not ok(r[3])
    assert not ok(r[4])           # a ticket left counted: the next call merges nothing
    assert not ok(r[5]) and not ok(r[6])          # the same in a two-level merge


@pytest.mark.slow
def test_seed_passes_the_real_evaluator_on_cpu() -> None:
    proc = subprocess.run([sys.executable, "-m", "evoattn.cli", "eval", str(SEED), "--problem",
                           "decode", "--device", "cpu", "--trials", "2", "--reps", "2"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Correctness: PASS" in proc.stdout



# ---- on a GPU (the lead runs: pytest -m gpu tests/test_decode.py) -------------------------------
GPU_CONFIGS = ("B=3,Hq=32,Hkv=8,Sq=1,ctx=4096,D=64,lens=ragged;"
               "B=2,Hq=8,Hkv=1,Sq=4,ctx=2000,D=128,lens=edge")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_seed_passes_the_real_evaluator_on_gpu(dtype: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "evoattn.cli", "eval", str(SEED), "--problem",
                           "decode", "--device", "cuda", "--dtype", dtype, "--configs",
                           GPU_CONFIGS, "--trials", "2", "--reps", "10"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Correctness: PASS" in proc.stdout


@pytest.mark.gpu
def test_seed_never_synchronises_and_replays_from_a_cuda_graph() -> None:
    import importlib.util
    spec = importlib.util.spec_from_file_location("decode_seed", SEED)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    p = get_problem("decode")
    c = cfg(4, 32, 8, 4, 3000, lens="edge")
    dev = torch.device("cuda")
    inp = p.make_inputs(c, torch.float16, dev, torch.Generator(device=dev).manual_seed(0))
    p.call(mod.attention, inp, c)                        # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")              # a host synchronisation raises
    try:
        p.call(mod.attention, inp, c)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = p.call(mod.attention, inp, c)
    p.refill(inp, torch.Generator(device=dev).manual_seed(1))      # new values, same addresses
    graph.replay()
    torch.cuda.synchronize()
    ref = p.reference(inp, c)
    bound = 2 * (p.torch_in_dtype(inp, c).float() - ref).abs().max().item() + 1e-5
    assert (out.float() - ref).abs().max().item() <= bound


@pytest.mark.gpu
def test_seed_runs_under_torch_compile_cuda_graphs_from_a_first_call_there() -> None:
    """torch.compile(mode="reduce-overhead") warms a graph up with every allocation of its
    thread going to the graphs' private pool; the split kernel's merge tickets, kept across
    calls, are first made during that warm-up when the seed's first call is compiled (as a
    compiled generate's first decode step is), and torch refuses a kept buffer from the pool
    (RuntimeError: tensors in the cudagraph pool not tracked as outputs). Replays on new
    values in place stay right and leave every ticket zero."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("decode_seed_compiled", SEED)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    p = get_problem("decode")
    c = cfg(4, 32, 8, 1, 8192, lens="ragged")          # split: the merge's tickets are used
    dev = torch.device("cuda")
    inp = p.make_inputs(c, torch.float16, dev, torch.Generator(device=dev).manual_seed(0))

    @torch.library.custom_op("evoattn_test::decode_seed", mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           lens: torch.Tensor) -> torch.Tensor:       # as the exported package wraps it
        return mod.attention(q, k, v, lens)

    op.register_fake(lambda q, k, v, lens: torch.empty_like(q))
    step = torch.compile(lambda q, k, v, lens: op(q, k, v, lens) * 1.0,
                         mode="reduce-overhead", fullgraph=True)
    args = (inp["q"], inp["k"], inp["v"], inp["cache_seqlens"])
    for seed in range(4):                               # warm-up, record, replays
        p.refill(inp, torch.Generator(device=dev).manual_seed(seed))
        out = step(*args).clone()
        torch.cuda.synchronize()
        ref = p.reference(inp, c)
        bound = 2 * (p.torch_in_dtype(inp, c).float() - ref).abs().max().item() + 1e-5
        assert (out.float() - ref).abs().max().item() <= bound, seed
    assert mod._TICKETS and all(int(t.abs().sum()) == 0 for t in mod._TICKETS.values())


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
def test_a_growing_cache_reuses_one_prepared_launch_and_stays_right(fused: bool) -> None:
    """A generation's cache grows by one token a call: the seed prepares its launch once per
    call shape (not per length), switches between its one-split and split kernels as the length
    demands, and every call matches brute force (lengths 1 to 700, some 16-aligned, some not);
    with the merge fused, no merge kernel is prepared and every ticket is left at zero."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"decode_seed_grow_{fused}", SEED)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.FUSED_MERGE = fused
    torch.manual_seed(0)
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.float16)
    full = torch.randn(2, 2, 2, 704, 64, device="cuda", dtype=torch.float16)
    worst = 0.0
    for n in list(range(1, 40)) + list(range(250, 270)) + [511, 512, 513, 700]:
        k, v = full[0, :, :, :n].contiguous(), full[1, :, :, :n].contiguous()
        lens = torch.full((2,), n, dtype=torch.int32, device="cuda")
        out = mod.attention(q, k, v, lens)
        want = brute_force({"q": q.cpu(), "k": k.cpu(), "v": v.cpu(),
                            "cache_seqlens": lens.cpu(), "scale": 64 ** -0.5})
        worst = max(worst, (out.cpu().double() - want).abs().max().item())
    assert len(mod._LAUNCHES) == 1
    launch = next(iter(mod._LAUNCHES.values()))
    assert set(launch.kernels) == {True, False}        # both kernels met, each prepared once
    import triton
    if triton.__version__.startswith("3.6"):        # launched beneath Triton's Python wrapper
        assert launch.kernels[True][0][1] is not None and launch.kernels[False][0][1] is not None
        assert (launch.kernels[False][2] is None) == fused
        assert fused or launch.kernels[False][2][1] is not None
    assert all(int(t.abs().sum()) == 0 for t in mod._TICKETS.values()) and \
        bool(mod._TICKETS) == fused
    assert worst < 2e-3


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
