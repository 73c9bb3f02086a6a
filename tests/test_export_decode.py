"""An exported `decode` kernel: its op with the lengths argument, its SDPA fallback, and a tiny
Hugging Face Llama generating through it (the CPU guard sends every call to the fallback, so
what is checked is the routing: generation steps reach the op, a long prompt does not)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from evoattn.contract.types import Verdict
from evoattn import settings
from evoattn.export import export_run
from evoattn.sandbox import SubprocessEvaluator
from test_export_package import _py, _store_run, export_naive

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "seeds" / "decode" / "decode_triton.py"


def _export(tmp: Path, device: str) -> dict:
    """The decode seed, checked by the real evaluator on `device`, stored as a run and exported."""
    prob = settings.problem("decode")
    request = settings.eval_request("decode", prob, device, None, None,
                                    settings.evaluator_config(trials=1))
    ev = SubprocessEvaluator(dataclasses.replace(request, check_only=True))
    try:
        result = ev.evaluate(SEED.read_text(), ".py", SEED.name)
    finally:
        ev.close()
    assert result.verdict is Verdict.PASS, result.reason
    _store_run(tmp / "run", SEED.read_text(), dataclasses.replace(result, fitness=1.0),
               problem="decode")
    summary = export_run(tmp / "run", tmp / "out")
    return {"out": tmp / "out", "summary": summary}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    return _export(tmp_path_factory.mktemp("decode_pkg"), "cpu")


@pytest.mark.slow
def test_decode_op_falls_back_to_sdpa_over_the_lengths_on_cpu(exported) -> None:
    s = exported["summary"]
    got = _py(f"""
        import json, torch
        import {s.package} as pkg
        torch.manual_seed(0)
        q = torch.randn(3, 4, 2, 64)
        k, v = torch.randn(3, 2, 10, 64), torch.randn(3, 2, 10, 64)
        lens = torch.tensor([10, 1, 0], dtype=torch.int32)
        out = pkg.attention(q, k, v, lens)
        # by hand: query i of sequence b sees keys 0 .. L - 2 + i
        want = torch.zeros_like(q)
        for b, L in enumerate(lens.tolist()):
            for h in range(4):
                for i in range(2):
                    n = L - 2 + i + 1
                    if n > 0:
                        p = torch.softmax(q[b, h, i] @ k[b, h // 2, :n].T / 8.0, -1)
                        want[b, h, i] = p @ v[b, h // 2, :n]
        print(json.dumps({{"err": (out - want).abs().max().item(), "stats": pkg.stats()}}))
    """, cwd=exported["out"])
    r = json.loads(got.splitlines()[-1])
    assert r["err"] < 1e-5
    assert r["stats"]["fallback_reasons"] == {
        "verified on cpu only (the kernel runs on CUDA GPUs)": 1}


@pytest.mark.slow
def test_a_growing_cache_is_decided_once_per_doubling_of_its_length(exported) -> None:
    """A generation's cache grows by a token a call: with the guard told the CPU may run the
    kernel (Triton's interpreter), lengths 5 to 40 take four decisions (5-7, 8-15, 16-31,
    32-40), every call reaches the kernel and agrees with the fallback; a cache that is not
    contiguous is keyed by its exact shape and strides, and k and v of different lengths are
    decided apart from equal ones. A decision must hold for every length
    its key covers: a cache of 1.97e9 elements whose key reaches 3.2e9 is past 2**31."""
    s = exported["summary"]
    got = _py(f"""
        import json, torch
        import {s.package} as pkg
        from {s.package} import _keys, decode, guard, ops
        guard.KERNEL_DEVICE_TYPES = ("cpu",)
        made = []
        decide = ops._decide
        ops._decide = lambda values, key: made.append(values[1].shape[2]) or decide(values, key)
        torch.manual_seed(0)
        q = torch.randn(2, 4, 1, 64).half()
        full_k, full_v = torch.randn(2, 2, 48, 64).half(), torch.randn(2, 2, 48, 64).half()
        err = 0.0
        for n in range(5, 41):
            k, v = full_k[:, :, :n].contiguous(), full_v[:, :, :n].contiguous()
            lens = torch.full((2,), n, dtype=torch.int32)
            out = pkg.attention(q, k, v, lens)
            want = decode.fallback(q.float(), k.float(), v.float(), lens)
            err = max(err, (out.float() - want).abs().max().item())
        contiguous = list(made)
        for n in (20, 21):                       # views of the full cache: strided, exact keys
            pkg.attention(q, full_k[:, :, :n], full_v[:, :, :n],
                          torch.full((2,), n, dtype=torch.int32))
        strided, stats = made[len(contiguous):], pkg.stats()
        before = len(made)                       # k and v of different lengths, one key's range
        try:
            pkg.attention(q, full_k[:, :, :9].contiguous(), full_v[:, :, :10].contiguous(),
                          torch.full((2,), 9, dtype=torch.int32))
        except Exception:
            pass
        mismatch_decided = len(made) == before + 1
        big, small = (torch.empty(*shape, device="meta")
                      for shape in ((96, 8, 20000, 128), (1, 8, 4097, 128)))
        print(json.dumps({{"made": contiguous, "strided": strided,
                          "mismatch_decided": mismatch_decided,
                          "err": err, "stats": stats,
                          "too_far": [_keys.grown_too_far({{"k": t, "v": t}})
                                      for t in (big, small)]}}))
    """, cwd=exported["out"], env={"TRITON_INTERPRET": "1"})
    r = json.loads(got.splitlines()[-1])
    assert r["made"] == [5, 8, 16, 32]
    assert r["strided"] == [20, 21]
    assert r["mismatch_decided"]          # not served by the decision for equal lengths
    assert r["stats"]["kernel"] == 36 + 2 and r["stats"]["fallback"] == 0
    assert r["err"] < 2e-3
    assert r["too_far"] == [True, False]


# A Llama of 2 layers, 4 query and 2 key/value heads of 64 (a verified head dim)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=97)

GENERATE = """
        import json, torch, torch._dynamo
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.generation.configuration_utils import CompileConfig
        import {package} as pkg
        from {package} import guard, hf
        if {on_kernel}:
            guard.KERNEL_DEVICE_TYPES = ("cpu",)       # Triton's interpreter runs the kernel
        hf.register()
        cfg = LlamaConfig(**{tiny})
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval().to("{device}", torch.{dtype})
        out = {{}}
        for name, prompt, cache, pad, compiled in {cases}:
            ids = torch.randint(1, 97, (2, prompt), device="{device}")
            mask = torch.ones_like(ids)
            ids[0, :pad], mask[0, :pad] = 0, 0                   # left padding
            kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=mask)
            if cache:
                kw["cache_implementation"] = cache
            if cache and not compiled:     # on a GPU generate compiles a static cache's
                kw["disable_compile"] = True   # steps unless told not to
            if compiled:
                kw["compile_config"] = CompileConfig(fullgraph=True, backend=compiled,
                                                     mode={mode})
                kw["compile_config"]._compile_all_devices = True
            with torch.no_grad():
                model.set_attn_implementation("sdpa")
                ref = model.generate(ids, **kw)
                model.set_attn_implementation("evoattn")
                torch._dynamo.reset()
                pkg.reset_stats()
                got = model.generate(ids, **kw)
            out[name] = {{"same": bool(torch.equal(ref, got)), "stats": pkg.stats()}}
        print(json.dumps(out))
"""

# (name, prompt length, cache_implementation, left padding of sequence 0, compile backend)
CASES = [("long", 21, None, 0, None), ("short", 5, None, 0, None),
         ("static_long", 21, "static", 0, None), ("static_short", 5, "static", 0, None),
         ("padded", 21, None, 3, None), ("static_padded", 21, "static", 3, None)]
CPU = "verified on cpu only (the kernel runs on CUDA GPUs)"
PATTERN = "decode: this call's pattern is not the kernel's"
PADDED = "an attention mask (padding or a pattern)"


def _generate(package: str, cwd: Path, device: str, dtype: str, cases: list,
              on_kernel: bool = False, mode: str | None = None) -> dict:
    got = _py(GENERATE.format(package=package, device=device, dtype=dtype, cases=cases,
                              on_kernel=on_kernel, mode=repr(mode), tiny=TINY),
              cwd=cwd, env={"TRITON_INTERPRET": "1"} if on_kernel else None)
    return json.loads(got.splitlines()[-1])


@pytest.mark.slow
def test_tiny_llama_generates_through_the_decode_op(exported) -> None:
    """8 new tokens: a prefill and 7 one-token steps, 2 layers each. The steps reach the op over
    the dynamic and the static cache (whose lengths come from the device), so does a prompt of
    at most 16 tokens; a 21-token prompt and a padded batch run transformers' SDPA path."""
    s = exported["summary"]
    r = _generate(s.package, exported["out"], "cpu", "float32", CASES)
    assert all(case["same"] for case in r.values()), r
    for name in ("long", "static_long"):
        assert r[name]["stats"]["fallback_reasons"] == {CPU: 14, PATTERN: 2}, name
    for name in ("short", "static_short"):
        assert r[name]["stats"]["fallback_reasons"] == {CPU: 16}, name
    for name in ("padded", "static_padded"):
        assert r[name]["stats"]["fallback_reasons"] == {PADDED: 16}, name


@pytest.mark.slow
def test_static_cache_steps_run_the_kernel_eager_and_compiled(exported) -> None:
    """With the guard told the CPU may run the kernel (Triton's interpreter): over a static
    cache, eager and under torch.compile(fullgraph=True) as generate compiles its steps, every
    step runs the kernel and the greedy tokens are SDPA's (float16)."""
    s = exported["summary"]
    r = _generate(s.package, exported["out"], "cpu", "float16",
                  [("static", 21, "static", 0, None), ("compiled", 5, "static", 0, "inductor")],
                  on_kernel=True)
    assert r["static"]["same"] and r["compiled"]["same"], r
    assert r["static"]["stats"]["kernel"] == 14
    assert r["static"]["stats"]["fallback_reasons"] == {PATTERN: 2}
    assert r["compiled"]["stats"]["kernel"] == 16 and r["compiled"]["stats"]["fallback"] == 0


def test_the_mask_becomes_lengths_only_where_the_kernel_computes_it(exported) -> None:
    """decode.mask_lengths, the rule behind the route: lengths for 1-16 causal new tokens over
    the dynamic cache (an int offset) or the static one (a tensor offset, read on the device,
    never past the cache), with no padding; None (transformers' mask) for padding anywhere, a
    window or pattern, an offset key range, more than 16 tokens, and for a 2D mask while
    torch.compile traces (reading it would break the graph)."""
    s = exported["summary"]
    got = _py(f"""
        import json, torch
        from {s.package}.decode import mask_lengths
        ones, holed = torch.ones(2, 12, dtype=torch.bool), torch.ones(2, 12, dtype=torch.bool)
        holed[1, 5] = False
        left = torch.ones(2, 12, dtype=torch.bool)
        left[0, :3] = False
        def lens(*args, **kw):
            out = mask_lengths(*args, **kw)
            return None if out is None else [out.dtype == torch.int32, out.tolist()]
        static = torch.tensor(11)
        r = {{
            "step": lens(2, 1, 12, 11, 0, None, True, "cpu"),
            "step_ones": lens(2, 1, 12, 11, 0, ones, True, "cpu"),
            "four": lens(2, 4, 12, 8, 0, ones, True, "cpu"),
            "static": lens(2, 1, 40, static, 0, ones, True, "cpu"),
            "static_clamped": lens(2, 1, 8, static, 0, None, True, "cpu"),
            "holed": lens(2, 1, 12, 11, 0, holed, True, "cpu"),
            "left_padded": lens(2, 1, 12, 11, 0, left, True, "cpu"),
            "short_mask": lens(2, 1, 13, 12, 0, ones, True, "cpu"),
            "pattern": lens(2, 1, 12, 11, 0, None, False, "cpu"),
            "kv_offset": lens(2, 1, 12, 11, 3, None, True, "cpu"),
            "seventeen": lens(2, 17, 17, 0, 0, None, True, "cpu"),
            "past_cache": lens(2, 1, 11, 11, 0, None, True, "cpu"),
        }}
        traced = []
        @torch.compile(fullgraph=True, backend="eager")
        def under_compile(mask, q):
            traced.append(mask_lengths(2, 1, 12, 11, 0, mask, True, "cpu"))
            return q + 1
        under_compile(ones, torch.zeros(1))
        r["compiling_with_mask"] = traced[0] is None
        print(json.dumps(r))
    """, cwd=exported["out"])
    r = json.loads(got.splitlines()[-1])
    assert r["step"] == r["step_ones"] == [True, [12, 12]]
    assert r["four"] == [True, [12, 12]]
    assert r["static"] == [True, [12, 12]] and r["static_clamped"] == [True, [8, 8]]
    for name in ("holed", "left_padded", "short_mask", "pattern", "kv_offset", "seventeen",
                 "past_cache"):
        assert r[name] is None, name
    assert r["compiling_with_mask"]


@pytest.mark.slow
def test_new_tokens_against_a_longer_cache_reach_the_op(exported) -> None:
    """4 new tokens (a draft model's proposals, verified in one forward) after 12 cached ones:
    the op serves them, causal among themselves, with the logits of transformers' SDPA."""
    s = exported["summary"]
    got = _py(f"""
        import json, torch
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
        import {s.package} as pkg
        from {s.package} import hf
        hf.register()
        cfg = LlamaConfig(**{TINY})
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
        ids = torch.randint(1, 97, (2, 16))
        logits = {{}}
        for impl in ("sdpa", "evoattn"):
            model.set_attn_implementation(impl)
            cache = DynamicCache(config=cfg)
            with torch.no_grad():
                model(ids[:, :12], past_key_values=cache, use_cache=True)
                pkg.reset_stats()
                logits[impl] = model(ids[:, 12:], past_key_values=cache, use_cache=True).logits
        print(json.dumps({{"err": (logits["sdpa"] - logits["evoattn"]).abs().max().item(),
                          "scale": logits["sdpa"].abs().max().item(), "stats": pkg.stats()}}))
    """, cwd=exported["out"])
    r = json.loads(got.splitlines()[-1])
    assert r["stats"]["fallback_reasons"] == {CPU: 2}          # both layers reached the op
    assert r["err"] < 1e-4 * max(1.0, r["scale"])


@pytest.mark.slow
def test_prompts_go_to_a_prefill_package_when_one_is_given(exported, tmp_path) -> None:
    """register(prefill=an sdpa package): the prompt's calls, which the decode kernel does not
    take, reach that package's op (its kernel told the CPU may run it) instead of SDPA; the
    steps stay on the decode op; the tokens are SDPA's. A package of another problem, or the
    package itself, is refused with the reason."""
    dec, pre = exported["summary"].package, export_naive(tmp_path)
    got = _py(f"""
        import json, torch
        from transformers import LlamaConfig, LlamaForCausalLM
        import {dec} as dec, {pre["summary"].package} as pre
        from {dec} import hf
        from {pre["summary"].package} import guard, hf as pre_hf
        guard.KERNEL_DEVICE_TYPES = ("cpu",)
        refused = []
        for register, other in ((hf.register, dec), (hf.register, "{dec}"),
                                (pre_hf.register, dec)):
            try:
                register("x", prefill=other)
            except ValueError as e:
                refused.append(str(e))
        assert hf.register(prefill=pre) == "evoattn"
        cfg = LlamaConfig(**{TINY})
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval().half()     # the naive kernel's verified dtype
        ids = torch.randint(1, 97, (2, 21))
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
        with torch.no_grad():
            model.set_attn_implementation("sdpa")
            ref = model.generate(ids, **kw)
            model.set_attn_implementation("evoattn")
            got = model.generate(ids, **kw)
        print(json.dumps({{"same": bool(torch.equal(ref, got)), "refused": refused,
                          "decode": dec.stats(), "prefill": pre.stats()}}))
    """, cwd=exported["out"], env={"PYTHONPATH": str(pre["out"])})
    r = json.loads(got.splitlines()[-1])
    assert r["same"], r
    assert r["decode"]["fallback_reasons"] == {CPU: 14}, r              # the 7 steps, 2 layers
    assert r["prefill"]["kernel"] == 2 and r["prefill"]["fallback"] == 0, r   # the prompt
    assert len(r["refused"]) == 3, r["refused"]
    assert all("cannot take its own" in m for m in r["refused"][:2])
    assert "is a decode kernel; prompts need an sdpa or gqa one" in r["refused"][2]


@pytest.mark.gpu
def test_tiny_llama_generation_steps_run_the_kernel_on_gpu(tmp_path) -> None:
    """float16 on the GPU: the dynamic and the static cache, eager, and the static cache's
    steps compiled as generate compiles them (CUDA graphs), all on the kernel."""
    ex = _export(tmp_path, "cuda")
    r = _generate(ex["summary"].package, ex["out"], "cuda", "float16",
                  CASES + [("compiled", 21, "static", 0, "inductor")], mode="reduce-overhead")
    assert all(case["same"] for case in r.values()), r
    # replays of a CUDA graph run no Python, so the compiled steps are counted only as traced
    assert r["compiled"]["stats"]["kernel"] > 0
    assert set(r["compiled"]["stats"]["fallback_reasons"]) <= {PATTERN}, r["compiled"]
    for name in ("long", "static_long"):
        assert r[name]["stats"]["kernel"] == 14, (name, r[name])
        assert r[name]["stats"]["fallback_reasons"] == {PATTERN: 2}, (name, r[name])
    for name in ("short", "static_short"):
        assert r[name]["stats"]["kernel"] == 16 and r[name]["stats"]["fallback"] == 0, name
    for name in ("padded", "static_padded"):
        assert r[name]["stats"]["fallback_reasons"] == {PADDED: 16}, name


def test_generation_benchmark_times_both_implementations_in_interleaved_rounds(monkeypatch):
    """Warm-ups first, then per round each implementation's prefill and whole generation, the
    order reversed every round; the counts start after the warm-ups; the speedup is the median
    of the rounds' decode-time ratios, with their range."""
    import argparse
    import torch
    from benchmarks import decode_generate as bench
    state, calls = {}, []
    # (prefill, whole generation) seconds per implementation and round: decode 2, 4, 3 s for
    # SDPA and 1, 1, 2 s for evoattn
    script = {"sdpa": [(1.0, 3.0), (1.0, 5.0), (1.0, 4.0)],
              "evoattn": [(1.0, 2.0), (1.0, 2.0), (1.0, 3.0)]}

    class Model:
        def set_attn_implementation(self, name):
            state["impl"] = name

    class Pkg:
        resets = 0

        def reset_stats(self):
            Pkg.resets += 1
            state["reset_at"] = len(calls)

    def fake_generate(model, ids, new, device, **kw):
        impl = state["impl"]
        rounds_done = sum(1 for i, n in calls[2:] if i == impl and n > 1)
        calls.append((impl, new))
        if len(calls) <= 2:                                            # the warm-ups
            return torch.tensor([0]), 99.0
        pre, tot = script[impl][rounds_done]
        return torch.tensor([len(calls)]), (tot if new > 1 else pre)

    monkeypatch.setattr(bench, "timed_generate", fake_generate)
    a = argparse.Namespace(runs=3, new=9, batch=2)
    times, tokens = bench.timed_rounds(Model(), None, a, None, {}, [Pkg()])
    s, e = ("sdpa", 9), ("evoattn", 9)
    assert calls == [s, e, ("sdpa", 1), s, ("evoattn", 1), e,
                     ("evoattn", 1), e, ("sdpa", 1), s, ("sdpa", 1), s, ("evoattn", 1), e]
    assert Pkg.resets == 1 and state["reset_at"] == 2
    assert times["sdpa"]["total_s"] == [3.0, 5.0, 4.0]
    assert times["evoattn"]["prefill_s"] == [1.0, 1.0, 1.0]
    assert int(tokens["sdpa"]) == 4 and int(tokens["evoattn"]) == 6    # the first round's
    got = bench.summarise(times, a)
    assert got["sdpa"]["decode_s_runs"] == [2.0, 4.0, 3.0] and got["sdpa"]["decode_s"] == 3.0
    assert got["evoattn"]["tokens_per_s"] == 2 * 8 / 1.0
    assert got["speedup_tokens_per_s"] == 2.0 and got["speedup_range"] == [1.5, 4.0]


@pytest.mark.slow
def test_generation_benchmark_runs_the_tiny_model_on_cpu(exported, tmp_path) -> None:
    """`decode_generate.py --tiny` on the CPU end to end: the same tokens, every implementation
    timed once per round, and the package's counts over the rounds only (each round: the
    prompt alone and the whole generation; on the CPU the steps fall back)."""
    import subprocess
    import sys
    out = tmp_path / "g.json"
    subprocess.run([sys.executable, "-m", "benchmarks.decode_generate",
                    "--export", str(exported["out"]), "--device", "cpu", "--tiny",
                    "--dtypes", "float32", "--runs", "2", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=600, cwd=ROOT)
    row = json.loads(out.read_text())["rows"][0]
    assert row["same_tokens"] and row["first_difference"] is None
    for impl in ("sdpa", "evoattn"):
        assert len(row[impl]["total_s_runs"]) == len(row[impl]["decode_s_runs"]) == 2
    # 2 rounds x (the prompt alone + the prompt and 7 steps) x 2 layers
    assert row["evoattn"]["calls"]["fallback_reasons"] == {PATTERN: 8, CPU: 28}, row
    assert row["forced"]["steps"] == 7 and row["forced"]["agrees"], row["forced"]
    assert set(row["forced"]["parting"]) == {"evoattn", "sdpa_math"}     # eager: both compared
    assert row["forced"]["median_gap"] >= 0.0
    ratios = sorted(s / e for s, e in zip(row["sdpa"]["decode_s_runs"],
                                          row["evoattn"]["decode_s_runs"]))
    assert row["speedup_range"] == [ratios[0], ratios[-1]]
    assert row["speedup_tokens_per_s"] == pytest.approx(sum(ratios) / 2)    # median of 2


def test_teacher_forced_agreement_tells_a_wrong_attention_from_sdpa(monkeypatch) -> None:
    """Against a float32 reference over SDPA's own tokens: SDPA in float32 agrees exactly, an
    implementation that drops the cache (each step sees only its own token) does not."""
    import torch
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface
    from benchmarks import decode_generate as bench

    def no_cache(module, query, key, value, attention_mask, **kw):
        return sdpa_attention_forward(module, query, key[:, :, -query.shape[2]:],
                                      value[:, :, -query.shape[2]:], None, **kw)

    monkeypatch.setitem(AttentionInterface._global_mapping, "evoattn", no_cache)
    # SDPA's masks for "evoattn" too, whatever a package registered earlier in this process
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "evoattn",
                        AttentionMaskInterface._global_mapping["sdpa"])
    monkeypatch.setattr(bench, "PREFILL_CHUNK", 5)       # the prompt in chunks of 5, 5, 2
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, initializer_range=0.5)).eval()
    ids = torch.randint(1, 97, (2, 12))
    with torch.no_grad():
        new = {}
        for impl in ("sdpa", "evoattn"):
            model.set_attn_implementation(impl)
            new[impl] = model.generate(ids, max_new_tokens=9, min_new_tokens=9, do_sample=False,
                                       pad_token_id=0)[:, 12:]
        got = bench.forced_agreement(model, model, ids, new["sdpa"],
                                     {"evoattn": new["evoattn"], "same": new["sdpa"].clone()})
    assert got["steps"] == 8
    assert got["sdpa"] == {"max_abs": 0.0, "top1": 1.0}
    assert got["evoattn"]["max_abs"] > 0.1 and got["evoattn"]["top1"] < 0.9
    assert not got["agrees"]
    # SDPA is its own reference here: where the cacheless tokens part from its own, the
    # reference prefers its token (a positive gap)
    assert got["median_gap"] > 0
    part = got["parting"]["evoattn"]
    k, b = part["token"], part["sequence"]
    assert (new["sdpa"][:, :k] == new["evoattn"][:, :k]).all()
    assert new["sdpa"][b, k] != new["evoattn"][b, k] and part["gap"] > 0
    assert got["parting"]["same"] is None


def test_parting_names_the_first_new_token_and_sequence_that_differ_and_the_gap() -> None:
    """The first column where any sequence differs, its first differing sequence, and the
    reference's logit of SDPA's token there less the other's."""
    import torch
    from benchmarks import decode_generate as bench
    forced = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    other = torch.tensor([[1, 2, 3, 0], [1, 2, 3, 4], [1, 2, 5, 4]])   # row 2 first, at k = 2
    refs = {k: torch.zeros(3, 8) for k in range(4)}
    refs[2][2, 3], refs[2][2, 5] = 1.5, 1.25
    assert bench.parting(forced, other, refs) == {"token": 2, "sequence": 2, "gap": 0.25}
    refs[2][2, 5] = 2.0                       # the reference prefers the other token
    assert bench.parting(forced, other, refs)["gap"] == -0.5
    assert bench.parting(forced, forced.clone(), refs) is None


def test_sdpa_math_runs_decode_steps_on_the_math_backend_and_prompts_as_sdpa(monkeypatch):
    """The benchmark's second SDPA: transformers' SDPA path, the decode steps with only the
    math backend enabled, the prompt with SDPA's default backends; its greedy tokens are an
    exact attention's (in float32 on the CPU, SDPA's own)."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM
    from benchmarks import decode_generate as bench
    bench.register_sdpa_math()
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        seen.append((q.shape[2], torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.math_sdp_enabled()))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    ids = torch.randint(1, 97, (2, 20))       # a prompt of more than 16 tokens
    out = {}
    with torch.no_grad():
        for impl in ("sdpa", "sdpa_math"):
            model.set_attn_implementation(impl)
            seen.clear()
            out[impl] = model.generate(ids, max_new_tokens=5, min_new_tokens=5,
                                       do_sample=False, pad_token_id=0)
            calls = list(seen)
    assert torch.equal(out["sdpa"], out["sdpa_math"])
    layers = TINY["num_hidden_layers"]
    assert calls[:layers] == [(20, True, True)] * layers               # the prompt: as SDPA
    assert calls[layers:] == [(1, False, True)] * (4 * layers)         # each step: math only


@pytest.mark.slow
def test_decode_step_benchmark_repeats_one_step_and_counts_its_calls(exported, tmp_path) -> None:
    """`decode_step.py --tiny` on the CPU: every timed step of a static cache writes the same
    slot (the cache set back before each), so the step's logits never change however often it
    runs; both harnesses' speedups are the median of their rounds' ratios; the evoattn step's
    attention calls are counted (one per layer, falling back on the CPU)."""
    import subprocess
    import sys

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from benchmarks import decode_step as bench
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=97)).eval()
    ids = torch.randint(1, 97, (2, 12))
    with torch.no_grad():
        cache = bench.prefilled(model, ids, 20)
        rewind = bench.rewinder(cache, 12)
        kw = {"use_cache": True, "position_ids": torch.full((2, 1), 12),
              "attention_mask": torch.ones(2, 13, dtype=torch.long),
              **bench.forward_kwargs(model, cache, torch.tensor([12]))}
        tok = torch.tensor([[5], [7]])
        first = None
        for _ in range(4):
            rewind()
            logits = model(tok, **kw).logits
            first = logits if first is None else first
            assert torch.equal(logits, first) and cache.get_seq_length() == 13
        # without the rewind the next step would land one slot further on
        model(tok, **kw)
        assert cache.get_seq_length() == 14

    out = tmp_path / "s.json"
    subprocess.run([sys.executable, "-m", "benchmarks.decode_step", "--export",
                    str(exported["out"]), "--device", "cpu", "--tiny", "--dtypes", "float32",
                    "--rounds", "3", "--loop", "2", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=600, cwd=ROOT)
    row = json.loads(out.read_text())["rows"][0]
    loop = row["eager"]["loop"]
    ratios = sorted(s / e for s, e in zip(loop["sdpa_runs_ms"], loop["evoattn_runs_ms"]))
    assert len(ratios) == 3 and loop["speedup"] == ratios[1]
    assert loop["speedup_range"] == [ratios[0], ratios[-1]]
    assert "do_bench" not in row["eager"] and "do_bench" not in row["compiled"]   # GPU only
    assert row["calls"]["eager"]["fallback_reasons"] == {CPU: 8}, row["calls"]   # 4 steps
    assert row["eager"]["max_abs_logits"] < 1e-5
    # compiled as generate compiles a static cache's steps: the mask built outside the trace
    # sends every layer's call to the op (on the CPU, its fallback), not to transformers' SDPA
    assert row["calls"]["compiled"]["fallback_reasons"] == {CPU: 8}, row["calls"]
    assert row["compiled"]["max_abs_logits"] < 1e-4
