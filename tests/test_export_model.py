"""The `model` problem exported and served in transformers: a package of the model seed,
verified (as stored) in Triton's interpreter, registered in tiny Gemma 2, GPT-OSS, Mistral
and Llama models built from configs (bfloat16, random weights, on the CPU, where the guard is
told that the CPU may run the kernel, as test_export_problems.py does). Prefill calls run the
kernel with the layer's window, Gemma 2's softcap and GPT-OSS's sinks; calls over a cache run
the model's own path, counted with their reason; logits match eager within the dtype rule."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from evoattn.contract.types import ConfigResult, EvalResult, Verdict
from evoattn.config import RunConfig, config_to_dict
from evoattn.export import export_run
from evoattn.export_package import verified_set
from evoattn.store import RunStore
from evoattn.types import Program, program_id

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "seeds" / "model" / "model_triton.py"
# what the stored evaluation checked: every feature at D=64, in bfloat16
VERIFIED = ({"B": 1, "H": 2, "Hkv": 1, "S": 64, "D": 64, "window": 0, "softcap": 0.0,
             "sinks": False},
            {"B": 1, "H": 4, "Hkv": 2, "S": 64, "D": 64, "window": 16, "softcap": 5.0,
             "sinks": True})


def _result(configs: tuple[dict, ...]) -> EvalResult:
    return EvalResult(verdict=Verdict.PASS, reason="", fitness=1.0, problem="model",
                      configs=tuple(ConfigResult(params=c, dtype="bfloat16", verdict=Verdict.PASS)
                                    for c in configs),
                      device="cpu", timing_device="cpu", device_info={})


def export_model(tmp: Path, verified: tuple[dict, ...] = VERIFIED) -> tuple[Path, object]:
    """Exports a run of the model seed, evaluated (as stored) on the CPU's interpreter on the
    `verified` configs."""
    source = SEED.read_text()
    cfg = config_to_dict(RunConfig())
    cfg["problem"] = "model"
    prog = Program(id=program_id(source), source=source, suffix=".py", parent_id=None,
                   iteration=0, island=0, mutator="seed", change="", result=_result(verified))
    with RunStore.open(tmp / "run", cfg, create=True) as s:
        s.commit_iteration(iteration=0, program=prog, rejection=None, llm_usage=None,
                           rng_state=random.Random(0).getstate(), population_snapshot={})
    return tmp / "out", export_run(tmp / "run", tmp / "out")


def _py(code: str, cwd: Path) -> str:
    """Runs code in a fresh process in the interpreter (the C++ call path is not built: its
    tests are test_export_package's); returns its stdout."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "TRITON_INTERPRET": "1", "EVOATTN_NATIVE": "0"})
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


MODELS = """
    import json, torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, GptOssConfig,
                              GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM)
    import {package} as pkg
    from {package} import guard, hf
    guard.KERNEL_DEVICE_TYPES = ("cpu",)       # the interpreter serves the kernel here
    mod = pkg.load_kernel_module()
    seen = []                                  # what each kernel call computes
    real_attention = mod.attention
    def watched(q, k, v, scale=None, window=0, softcap=0.0, sinks=None):
        seen.append([window, softcap, sinks is not None and sinks.dtype == torch.float32])
        return real_attention(q, k, v, scale=scale, window=window, softcap=softcap, sinks=sinks)
    mod.attention = watched
    hf.register()
    # 2 layers, 2 query heads and 1 key/value head of {head_dim} (GQA), windows of 8 over 24
    base = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim={head_dim}, vocab_size=97)
    models = {{
        "gemma2": (Gemma2ForCausalLM, Gemma2Config(
            **base, sliding_window=8, attn_logit_softcapping=20.0, final_logit_softcapping=30.0,
            query_pre_attn_scalar=64)),
        "gpt_oss": (GptOssForCausalLM, GptOssConfig(
            **base, sliding_window=8, num_local_experts=4, num_experts_per_tok=2)),
        "mistral": (MistralForCausalLM, MistralConfig(**base, sliding_window=8)),
        "llama": (LlamaForCausalLM, LlamaConfig(**base)),
    }}
    out = {{}}
    for name, (cls, cfg) in models.items():
        torch.manual_seed(0)
        model = cls(cfg).eval()
        for layer in model.model.layers:           # GPT-OSS's sinks start at zero: not here
            if hasattr(layer.self_attn, "sinks"):
                torch.nn.init.normal_(layer.self_attn.sinks)
        ids = torch.randint(1, 97, (2, 24))
        padding = torch.ones_like(ids)
        padding[0, :3] = 0                          # left padding
        r = {{}}
        for case, kw in (("plain", {{}}), ("padded", {{"attention_mask": padding}})):
            with torch.no_grad():
                model.float().set_attn_implementation("eager")
                exact = model(ids, **kw).logits     # float32: the reference
                model.bfloat16()
                eager = model(ids, **kw).logits.float()
                model.set_attn_implementation("evoattn")
                pkg.reset_stats()
                seen.clear()
                got = model(ids, **kw).logits.float()
            kept = kw.get("attention_mask", torch.ones_like(ids)).bool()
            r[case] = {{"err": (got - exact)[kept].abs().max().item(),
                       "eager_err": (eager - exact)[kept].abs().max().item(),
                       "stats": pkg.stats(), "seen": list(seen)}}
        with torch.no_grad():                       # a prefill and 3 steps over the cache
            kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
            model.set_attn_implementation("eager")
            ref = model.generate(ids[1:], **kw)
            model.set_attn_implementation("evoattn")
            pkg.reset_stats()
            got = model.generate(ids[1:], **kw)
        r["generate"] = {{"same": bool(torch.equal(ref, got)), "stats": pkg.stats()}}
        out[name] = r
    print(json.dumps(out))
"""

MASK = "an attention mask (padding or a pattern)"
CACHE = "query and key lengths differ (decoding with a cache)"
EAGER = "; ran the model's eager attention"
# what the kernel computes per layer of a plain prefill: [window, softcap, float32 sinks]
FEATURES = {"gemma2": [[8, 20.0, False], [0, 20.0, False]],     # sliding, then global
            "gpt_oss": [[8, 0.0, True], [0, 0.0, True]],
            "mistral": [[8, 0.0, False], [8, 0.0, False]],       # every layer slides
            "llama": [[0, 0.0, False], [0, 0.0, False]]}


def _within_dtype_rule(case: dict) -> bool:
    """The problem's tolerance on logits: the kernel's error against float32 within twice
    eager's own in bfloat16."""
    from evoattn.problems import get_problem
    return case["err"] <= get_problem("model").tolerance.bound(case["eager_err"])


def _serve(out: Path, package: str, head_dim: int = 64) -> dict:
    return json.loads(_py(MODELS.format(package=package, head_dim=head_dim),
                          cwd=out).splitlines()[-1])


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    out, s = export_model(tmp_path_factory.mktemp("model"))
    return _serve(out, s.package)


@pytest.mark.parametrize("model", sorted(FEATURES))
def test_prefill_runs_the_kernel_with_the_layers_features(served, model):
    plain = served[model]["plain"]
    assert plain["stats"] == {"kernel": 2, "fallback": 0, "fallback_reasons": {}}, plain
    assert plain["seen"] == FEATURES[model], plain
    assert _within_dtype_rule(plain), plain


@pytest.mark.parametrize("model, eager", [("gemma2", EAGER), ("gpt_oss", EAGER),
                                          ("mistral", ""), ("llama", "")])
def test_a_padded_prefill_runs_the_models_own_path_counted(served, model, eager):
    padded = served[model]["padded"]
    assert padded["stats"]["kernel"] == 0 and padded["seen"] == [], padded
    assert padded["stats"]["fallback_reasons"] == {MASK + eager: 2}, padded
    assert _within_dtype_rule(padded), padded


def test_decode_steps_run_the_models_own_path_counted_and_generate_as_eager(served):
    # Gemma 2 and GPT-OSS: the global layer's step has no mask, the sliding one's a window
    # mask; both pass softcap or sinks, so the model's eager attention runs them
    mixed = {MASK + EAGER: 3, CACHE + EAGER: 3}
    expected = {"gemma2": mixed, "gpt_oss": mixed, "mistral": {MASK: 6}, "llama": {CACHE: 6}}
    for model, reasons in expected.items():
        gen = served[model]["generate"]
        assert gen["same"], (model, gen)
        assert gen["stats"]["kernel"] == 2 and gen["stats"]["fallback_reasons"] == reasons, \
            (model, gen)


def test_a_feature_no_verified_config_had_falls_back_counted(tmp_path):
    """A package verified on plain causal configs only: a call with a window, softcap or sinks
    runs the op's fallback (the eager math where softcap or sinks are set), counted with the
    feature; the logits stay within the dtype rule."""
    out, s = export_model(tmp_path, VERIFIED[:1])
    served = _serve(out, s.package)
    expected = {"gemma2": {"window=True (verified: [False])": 1,
                           "softcap=True (verified: [False])": 1},
                "gpt_oss": {"window=True (verified: [False])": 1,
                            "sinks=True (verified: [False])": 1},
                "mistral": {"window=True (verified: [False])": 2}}
    for model, reasons in expected.items():
        plain = served[model]["plain"]
        assert plain["stats"]["kernel"] == 0 and plain["stats"]["fallback_reasons"] == reasons
        assert _within_dtype_rule(plain), (model, plain)
        assert served[model]["generate"]["same"], model
    assert served["llama"]["plain"]["stats"]["kernel"] == 2


def test_the_verified_set_records_the_features_its_configs_used():
    full, plain = verified_set(_result(VERIFIED)), verified_set(_result(VERIFIED[:1]))
    assert {k: full[k] for k in ("window", "softcap", "sinks")} == {
        "window": [False, True], "softcap": [False, True], "sinks": [False, True]}
    assert {k: plain[k] for k in ("window", "softcap", "sinks")} == {
        "window": [False], "softcap": [False], "sinks": [False]}
    assert full["head_dims"] == [64] and full["dtypes"] == ["bfloat16"]


# ---- the op's spec, in this process ---------------------------------------------------
def _op_inputs(cfg: dict, dtype: str = "bfloat16") -> tuple[object, dict]:
    import torch
    from evoattn.problems import get_problem
    problem = get_problem("model")
    return problem, problem.make_inputs(cfg, getattr(torch, dtype), "cpu",
                                        torch.Generator().manual_seed(0))


@pytest.mark.parametrize("window, softcap, sinks", [(0, 0.0, False), (5, 0.0, False),
                                                    (0, 2.0, False), (5, 0.0, True),
                                                    (1, 1.0, True), (100, 0.0, False)])
def test_the_ops_fallback_computes_every_feature_as_the_reference(window, softcap, sinks):
    import torch
    from evoattn.problems import model_op
    cfg = {"B": 1, "H": 4, "Hkv": 2, "S": 37, "D": 64, "window": window, "softcap": softcap,
           "sinks": sinks}
    problem, x = _op_inputs(cfg)
    spec = model_op.op_spec()
    # in float32 (the fallback runs in the call's dtype): the reference's math, exactly
    values = (x["q"].float(), x["k"].float(), x["v"].float(), x["scale"], x["window"],
              x["softcap"], x["sinks"])
    fallback = spec.fallback_for(spec.bind(values, {}))
    # SDPA only where it computes the call whole: never with softcap or sinks
    assert (fallback is model_op.sdpa_fallback) == (not softcap and not sinks)
    torch.testing.assert_close(fallback(*values), problem.reference(x, cfg), atol=1e-5,
                               rtol=1e-5)


def test_the_ops_shape_rule_takes_the_contract_and_refuses_the_rest():
    import torch
    from evoattn.problems import model_op
    cfg = {"B": 1, "H": 4, "Hkv": 2, "S": 9, "D": 64, "window": 0, "softcap": 0.0,
           "sinks": True}
    _, x = _op_inputs(cfg, "bfloat16")
    spec = model_op.op_spec()
    q, k, v, sinks = x["q"], x["k"], x["v"], x["sinks"]

    def refusal(*values: object, **named: object) -> str | None:
        return spec.shape_refusal(spec.bind(values, named))
    assert refusal(q, k, v, sinks=sinks) is None and refusal(q, q, q, window=3) is None
    assert "H % Hkv" in refusal(q, k[:, :, :5], v[:, :, :5])           # k, v of another S
    assert "H % Hkv" in refusal(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1))
    assert "head dim 32" in refusal(q[..., :32], k[..., :32], v[..., :32])
    assert "dtype" in refusal(q.float(), k.float(), v.float())
    assert "sinks must be float32" in refusal(q, k, v, sinks=sinks.bfloat16())
    assert "sinks must be float32" in refusal(q, k, v, sinks=sinks[:2])
    assert ">= 0" in refusal(q, k, v, window=-1)
    assert spec.flags(spec.bind((q, k, v), {"softcap": 3.0, "sinks": sinks})) == {
        "window": False, "softcap": True, "sinks": True}


def test_the_transformers_route_maps_the_layers_keywords():
    """hf_call reads sliding_window, softcap and s_aux by identity (a sinks tensor has no
    truth value), casts the sinks to float32 and takes causal prefill only."""
    import torch
    from evoattn.problems import model_op
    calls = []

    def attention(*values: object) -> str:
        calls.append(values)
        return "out"
    q = k = v = torch.zeros(1, 2, 6, 64, dtype=torch.bfloat16)
    s_aux = torch.nn.Parameter(torch.randn(2, dtype=torch.bfloat16))
    assert model_op.hf_call(attention, q, k, v, None, 0.125, 4, True, softcap=None,
                            s_aux=s_aux) == "out"
    _, _, _, scale, window, softcap, sinks = calls[-1]
    assert (scale, window, softcap) == (0.125, 4, 0.0) and sinks.dtype == torch.float32
    assert torch.equal(sinks, s_aux.float())
    assert model_op.hf_call(attention, q, k, v, None, None, None, True, 20.0, None) == "out"
    assert calls[-1][3:] == (None, 0, 20.0, None)
    assert model_op.hf_call(attention, q, k, v, None, None, None, False) is None
    assert model_op.hf_call(attention, q, k[:, :, :2], v[:, :, :2], None, None, None,
                            True) is None
    assert len(calls) == 2


def test_the_mask_function_leaves_out_only_the_configs_sliding_window(tmp_path):
    """A local mask of the config's sliding_window is the kernel's to compute (None); another
    local mask (a chunked one, Llama 4's, which passes no argument the kernel reads) is built."""
    out, s = export_model(tmp_path)
    got = _py(f"""
        import json, types, torch
        from {s.package} import hf
        mask = hf._mask_function()
        cfg = types.SimpleNamespace(sliding_window=4)
        kw = dict(batch_size=1, q_length=9, kv_length=9, local_size=4, dtype=torch.float32,
                  device="cpu")
        print(json.dumps([mask(**kw, config=cfg) is None,
                          mask(**kw, config=types.SimpleNamespace(sliding_window=None)) is None,
                          mask(**{{**kw, "local_size": None}}, config=cfg) is None]))
    """, cwd=out)
    assert json.loads(got.splitlines()[-1]) == [True, False, True]
