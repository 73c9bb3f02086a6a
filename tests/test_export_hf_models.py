"""The exported package registered in transformers serves models whose attention has features
the kernel lacks: tiny Gemma 2 (logit softcapping, a sliding window on alternate layers),
GPT-OSS (attention sinks, a sliding window), Mistral (a sliding window) and Llama, built from
configs with random weights on the CPU. No call raises, the logits match the model's own eager
attention, and every call that falls back is counted with its reason."""
from __future__ import annotations

import json

import pytest
import torch

from evoattn.export_templates import _hf_fallback

from test_export_package import _py, export_naive

MASK = "an attention mask (padding or a pattern)"
CPU = "verified on cpu only (the kernel runs on CUDA GPUs)"
EAGER = "passed (the kernel takes none); ran the model's eager attention"
FLOAT32_ABS = 1e-4          # float32 on the CPU: the same math in another order

MODELS = """
    import json, torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, GptOssConfig,
                              GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM)
    import {package} as pkg
    from {package} import hf
    hf.register()
    # 2 layers, 2 query heads and 1 key/value head of 64 (GQA), windows of 8 over 24 tokens
    base = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=97)
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
                model.set_attn_implementation("eager")
                ref = model(ids, **kw).logits
                model.set_attn_implementation("evoattn")
                pkg.reset_stats()
                got = model(ids, **kw).logits
            kept = kw.get("attention_mask", torch.ones_like(ids)).bool()
            r[case] = {{"err": (got - ref)[kept].abs().max().item(), "stats": pkg.stats()}}
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


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    exported = export_naive(tmp_path_factory.mktemp("hf_models"))
    got = _py(MODELS.format(package=exported["summary"].package), cwd=exported["out"])
    return json.loads(got.splitlines()[-1])


def _reasons(stats: dict) -> dict:
    """The fallback reasons of calls that all fell back (the kernel does not run on the CPU)."""
    assert stats["kernel"] == 0, stats
    return stats["fallback_reasons"]


@pytest.mark.parametrize("model, feature", [("gemma2", "softcap"), ("gpt_oss", "s_aux")])
def test_a_feature_sdpa_lacks_runs_the_models_eager_attention_counted(served, model, feature):
    for case in ("plain", "padded"):
        got = served[model][case]
        assert got["err"] <= FLOAT32_ABS, (case, got)
        assert _reasons(got["stats"]) == {f"{feature} {EAGER}": 2}, (case, got)
    gen = served[model]["generate"]
    assert gen["same"] and _reasons(gen["stats"]) == {f"{feature} {EAGER}": 8}, gen


def test_a_sliding_window_model_falls_back_to_sdpa_with_its_window_mask(served):
    for case in ("plain", "padded"):
        got = served["mistral"][case]
        assert got["err"] <= FLOAT32_ABS and _reasons(got["stats"]) == {MASK: 2}, (case, got)
    gen = served["mistral"]["generate"]
    assert gen["same"] and _reasons(gen["stats"]) == {MASK: 8}, gen


def test_llama_calls_reach_the_op_and_fall_back_there_on_the_cpu(served):
    plain, padded = served["llama"]["plain"], served["llama"]["padded"]
    assert plain["err"] <= FLOAT32_ABS and _reasons(plain["stats"]) == {CPU: 2}, plain
    assert padded["err"] <= FLOAT32_ABS and _reasons(padded["stats"]) == {MASK: 2}, padded
    gen = served["llama"]["generate"]
    assert gen["same"] and _reasons(gen["stats"]) == {
        CPU: 2, "query and key lengths differ (decoding with a cache)": 6}, gen


def test_the_eager_mask_stands_for_what_the_packages_mask_function_left_out():
    """None is causality (bottom-right) with the layer's window; a boolean mask becomes an
    additive one of the dtype's lowest value (no NaN row where padding hides every key)."""
    q, k = torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 5, 4)
    low = torch.finfo(torch.float32).min
    keep = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    got = _hf_fallback.eager_mask(q, k, None, causal=True, window=3)
    assert torch.equal(got[0, 0], torch.zeros(3, 5).masked_fill(~keep, low))
    causal = _hf_fallback.eager_mask(q, k, None, causal=True, window=None)
    assert torch.equal(causal[0, 0] == 0, torch.ones(3, 5, dtype=torch.bool).tril(2))
    assert _hf_fallback.eager_mask(q[:, :, :1], k, None, causal=True, window=None) is None
    assert _hf_fallback.eager_mask(q, k, None, causal=False, window=None) is None
    hidden = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    assert torch.equal(_hf_fallback.eager_mask(q, k, hidden, True, None),
                       torch.full((1, 1, 3, 5), low))


def test_keyword_arguments_are_read_without_truth_testing_tensors():
    sinks = torch.randn(4)
    assert _hf_fallback.passed({"s_aux": sinks, "softcap": None, "output_attentions": False},
                               _hf_fallback.BEYOND_SDPA) == ("s_aux",)
