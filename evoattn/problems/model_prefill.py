"""`model`: the prefill attention of Gemma 2, GPT-OSS, Mistral and Llama in one contract.

Causal attention with grouped-query heads, and three optional features those models use: a
left sliding window (transformers' `sliding_window_causal_mask_function`: key j is visible
to query i iff i - W < j <= i), logit soft-capping (Gemma 2: cap * tanh(s / cap) on the
scaled scores, before the mask) and attention sinks (GPT-OSS: one learned logit per query
head that joins each row's softmax denominator and contributes no value). Every row sees at
least its own key, so no row is empty; a sink can still take almost all of a row's weight.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .base import BaselineSetProblem, Config, OpDocs, Tolerance
from .common import check_dtype, default_scale, flops_for_pairs, randn

HEAD_DIMS = (64, 128, 256)
KEYS = ("B", "H", "Hkv", "S", "D", "window", "softcap", "sinks")
OPTIONAL_KEYS = ("scale",)           # 0 or absent: 1/sqrt(D)
# Head 0's sink: exp(10) outweighs a row of a thousand unit-scale scores, so every check
# includes rows whose denominator the sink dominates (outputs near zero).
DOMINANT_SINK = 10.0
DOMAIN = ("any B >= 1, S >= 1; H % Hkv == 0; D in {64, 128, 256}; window >= 0 (0: none, "
          ">= S: plain causal); softcap >= 0 (0: none); sinks or not; scale > 0")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A config's sizes and features (window 0: none; softcap 0.0: none)."""

    B: int
    H: int
    Hkv: int
    S: int
    D: int
    window: int
    softcap: float
    sinks: bool
    scale: float


def shape_of(cfg: Config) -> ModelShape:
    """Returns the config's shape; raises ValueError naming the key that is missing or wrong."""
    missing = [k for k in KEYS if k not in cfg]
    unknown = [k for k in cfg if k not in KEYS + OPTIONAL_KEYS]
    if missing or unknown:
        what = (f"missing key(s) {', '.join(missing)}" if missing
                else f"unknown key(s) {', '.join(unknown)}")
        raise ValueError(f"model config {cfg}: {what}")
    B, H, Hkv, S, D, window = (int(cfg[k]) for k in ("B", "H", "Hkv", "S", "D", "window"))
    bad = {"B": B < 1, "S": S < 1, "window": window < 0, "softcap": float(cfg["softcap"]) < 0,
           "H": H < 1 or Hkv < 1 or H % Hkv != 0, "D": D not in HEAD_DIMS,
           "scale": float(cfg.get("scale", 0.0)) < 0}
    for key, wrong in bad.items():
        if wrong:
            raise ValueError(f"model config {cfg}: {key} is outside the contract ({DOMAIN})")
    scale = float(cfg.get("scale", 0.0)) or default_scale(D)
    return ModelShape(B, H, Hkv, S, D, window, float(cfg["softcap"]), bool(cfg["sinks"]), scale)


def visible_pairs(S: int, window: int) -> int:
    """Returns the (query, key) pairs of one head: sum over i of min(i + 1, W) (W = S if 0)."""
    w = S if window <= 0 or window >= S else window
    return S * w - w * (w - 1) // 2


def visible(i: Any, j: Any, window: int) -> Any:
    """Returns whether key j is visible to query i (index tensors; transformers' convention)."""
    keep = j <= i
    return keep & (j > i - window) if window > 0 else keep


def op_flags(window: int, softcap: float, sinks: bool) -> dict[str, bool]:
    """Returns the features a call or config uses, as an export's verified set records them
    and its guard checks them (a feature no verified config had falls back)."""
    return {"window": window > 0, "softcap": softcap > 0, "sinks": bool(sinks)}


def verified_flags(cfg: Config) -> dict[str, bool]:
    """Returns op_flags of a checked config (the exporter's verified set)."""
    s = shape_of(cfg)
    return op_flags(s.window, s.softcap, s.sinks)


def model_attention(q: Any, k: Any, v: Any, scale: float, window: int, softcap: float,
                    sinks: Any, round_p: Any = None) -> Any:
    """Returns the float32 answer, one (batch, key/value head) at a time (no repeated k/v).

    With `round_p` (a dtype) the unnormalised probabilities are rounded to it before P·V and
    the output is returned in it: a flash kernel's rounding, which sets the tolerance."""
    import torch
    B, H, S, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    idx = torch.arange(S, device=q.device)
    keep = visible(idx[:, None], idx[None, :], window)                  # (S, S)
    out = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        for g in range(Hkv):
            heads = slice(g * G, (g + 1) * G)
            s = torch.matmul(q[b, heads].float(), k[b, g].float().T) * scale   # (G, S, S)
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            s = s.masked_fill(~keep, float("-inf"))
            m = s.amax(-1, keepdim=True)                                 # finite: i sees i
            if sinks is not None:
                sink = sinks[heads].float()[:, None, None]               # (G, 1, 1)
                m = torch.maximum(m, sink)
            p = torch.exp(s - m)
            den = p.sum(-1, keepdim=True)
            if sinks is not None:
                den = den + torch.exp(sink - m)
            if round_p is not None:
                p = p.to(round_p).float()
            out[b, heads] = torch.matmul(p, v[b, g].float()) / den
    return out if round_p is None else out.to(round_p)


def _cfg(b: int, h: int, hkv: int, s: int, d: int, window: int = 0, softcap: float = 0.0,
         sinks: bool = False) -> Config:
    return {"B": b, "H": h, "Hkv": hkv, "S": s, "D": d, "window": window, "softcap": softcap,
            "sinks": sinks}


TOKENS = 16 * 1024                   # B * S of a benchmark config
# Gemma-2-2B: 8 query and 4 key/value heads of 256, softcap 50, query_pre_attn_scalar 256
# (scale 1/16 = 1/sqrt(D)), a 4096 window on alternate layers: distinct from the global
# layers only past 4096 tokens.
GEMMA2_2B = tuple(_cfg(TOKENS // s, 8, 4, s, 256, 0, 50.0) for s in (1024, 2048, 4096, 8192)) \
    + (_cfg(2, 8, 4, 8192, 256, 4096, 50.0),)
# GPT-OSS-20B: 64 query and 8 key/value heads of 64, sinks, a 128 window on alternate layers.
# 8k tokens at batch 1, not 2: the eager baseline holds several (B, 64, S, S) score tensors
# (17 GB each at B=2, S=8k in 16 bits), past a GPU's memory.
GPT_OSS_20B = tuple(_cfg(b, 64, 8, s, 64, w, 0.0, True)
                    for b, s in ((16, 1024), (8, 2048), (4, 4096), (1, 8192)) for w in (0, 128))


class ModelPrefill(BaselineSetProblem):
    name = "model"
    summary = ("causal GQA prefill with an optional sliding window, logit softcap and "
               "attention sinks (Gemma 2, GPT-OSS, Mistral, Llama)")
    contract = (
        "Compute causal attention for q of shape (B, H, S, D) and k, v of shape (B, Hkv, S, D), "
        "contiguous, float16 or bfloat16; query head h uses key/value head h // (H // Hkv) "
        "(H % Hkv == 0). Scores s = q k^T * scale (scale > 0; 1/sqrt(D) unless given: Gemma 2 "
        "passes query_pre_attn_scalar**-0.5). With softcap > 0, s = softcap * tanh(s / "
        "softcap), applied before the mask. Key j is visible to query i iff j <= i and, with "
        "window W > 0, j > i - W (transformers' sliding_window_causal_mask_function: a row "
        "sees its last W keys, itself included; W >= S is plain causal). With sinks, a float32 "
        "tensor of shape (H,), row i of head h is out = sum_j e^(s_ij) v_j / (sum_j e^(s_ij) + "
        "e^(sinks[h])) over its visible j: the sink joins the denominator and contributes no "
        "value (GPT-OSS). Call: attention(q, k, v, scale=float, window=int, softcap=float, "
        "sinks=Tensor or None), window 0 and softcap 0.0 meaning none. The output has the "
        "shape, dtype and device of q. Must be correct for " + DOMAIN + ". Inputs must not "
        "be modified; do not materialise repeated k/v. Accumulate in float32. FLOPs: 4 * B * "
        "H * D * (visible pairs), the pairs of a head sum_i min(i+1, W). Baselines, as "
        "transformers calls them: its eager path (scores materialised, softcap, additive "
        "mask, sinks concatenated, softmax), compiled FlexAttention (softcap score_mod, a "
        "BlockMask built once per config, sinks by renormalising with the log-sum-exp), SDPA "
        "with a boolean mask (timed only without softcap and sinks, which it cannot express) "
        "and flash-attn's flash_attn_func(softcap=, window_size=) where importable (timed "
        "only without sinks); fitness is the speedup over the fastest. Shapes outside the "
        "contract must raise ValueError."
    )
    dtypes = ("float16", "bfloat16")
    default_dtype = "bfloat16"
    default_configs = GEMMA2_2B + GPT_OSS_20B
    cpu_configs = (_cfg(1, 2, 1, 64, 256, 16, 5.0), _cfg(1, 4, 2, 64, 64, 16, 0.0, True))
    domain_configs = (
        _cfg(1, 6, 2, 77, 64),                              # odd S, plain causal GQA
        _cfg(2, 4, 1, 300, 128, 1000, 30.0),                # window larger than S
        _cfg(1, 4, 2, 200, 256, 1, 0.0, True),              # window 1: itself and the sink
        _cfg(1, 8, 4, 1000, 256, 100, 2.0),                 # an active cap, D=256
        _cfg(2, 8, 2, 129, 64, 16, 0.0, True),              # sinks, head 0's dominates
        _cfg(1, 2, 1, 1, 64, 0, 5.0, True),                 # one token
        _cfg(1, 4, 2, 333, 128, 64, 1.0, True),             # every feature at once
    )
    cpu_domain_configs = (_cfg(1, 3, 1, 37, 64, 1, 0.0, True),
                          _cfg(1, 2, 2, 45, 128, 100, 1.0),
                          _cfg(1, 2, 1, 20, 256, 0, 2.0, True))
    domain = DOMAIN
    tolerance = Tolerance(factor=2.0, floor=1e-5)
    implausible_speedup = 60.0   # a 128-of-8192 window skips 98% of eager's materialised work
    baseline_name = ("the fastest of transformers' eager path, compiled FlexAttention, SDPA "
                     "with a mask (window only) and flash_attn_func (when importable)")
    baseline_names = ("eager", "flex_attention", "sdpa", "flash_attn")
    random_inputs = ("q", "k", "v")       # the sinks are the model's weights: constant
    op_docs = OpDocs(
        call="attention(q, k, v, window=4096, softcap=50.0)",
        replaces="transformers' eager attention (Gemma 2, GPT-OSS, Mistral, Llama)",
        shapes="q: (B, H, S, D); k, v: (B, Hkv, S, D); causal; sinks: float32 (H,) or None",
        raw_args="None, 4096, 50.0", in_module=False,
        hf_declines="a padding mask, decoding with a cache",
        notes=("In transformers, a prefill call takes the layer's `sliding_window`, Gemma 2's "
               "`softcap` and GPT-OSS's sinks (`s_aux`) to the kernel; a call with a feature "
               "no verified config had falls back to the op's fallback (SDPA where it "
               "computes the call whole, transformers' eager math with softcap or sinks)."))

    def __init__(self) -> None:
        from .model_baselines import ModelBaselines
        self._base = ModelBaselines()

    def label(self, cfg: Config) -> str:
        s = shape_of(cfg)
        feats = [f"w{s.window}" if s.window else "", f"cap{s.softcap:g}" if s.softcap else "",
                 "sinks" if s.sinks else ""]
        return f"(B{s.B},{s.H}/{s.Hkv},{s.S},{s.D}) " + (" ".join(f for f in feats if f)
                                                           or "causal")

    def parse_configs(self, spec: str) -> list[Config]:
        """Parses `--configs` text ('key=value,...;...'), each config checked against the
        contract here, so a wrong one is a usage error, not a candidate's crash."""
        configs = super().parse_configs(spec)
        for cfg in configs:
            shape_of(cfg)
        return configs

    def flops(self, cfg: Config) -> float:
        s = shape_of(cfg)
        return flops_for_pairs(visible_pairs(s.S, s.window), s.B * s.H, s.D)

    # ---- tensors (child process only) -----------------------------------------------------
    def make_inputs(self, cfg: Config, dtype: Any, device: Any, gen: Any) -> dict[str, Any]:
        import torch
        check_dtype(self, dtype)
        s = shape_of(cfg)
        q = randn((s.B, s.H, s.S, s.D), gen, device, dtype)
        k = randn((s.B, s.Hkv, s.S, s.D), gen, device, dtype)
        v = randn((s.B, s.Hkv, s.S, s.D), gen, device, dtype)
        sinks = None
        if s.sinks:
            sinks = randn((s.H,), gen, device, torch.float32)
            sinks[0] = DOMINANT_SINK
        return {"q": q, "k": k, "v": v, "sinks": sinks, "window": s.window,
                "softcap": s.softcap, "scale": s.scale}

    def reference(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return model_attention(inputs["q"], inputs["k"], inputs["v"], inputs["scale"],
                               inputs["window"], inputs["softcap"], inputs["sinks"])

    def torch_in_dtype(self, inputs: dict[str, Any], cfg: Config) -> Any:
        q = inputs["q"]
        return model_attention(q, inputs["k"], inputs["v"], inputs["scale"], inputs["window"],
                               inputs["softcap"], inputs["sinks"], round_p=q.dtype)

    def baseline(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return self._base.eager(inputs, cfg)

    def extra_baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        def naive(inputs: dict[str, Any], cfg: Config) -> Any:
            return self.torch_in_dtype(inputs, cfg)
        return {"naive": naive}

    def call(self, fn: Callable[..., Any], inputs: dict[str, Any], cfg: Config) -> Any:
        return fn(inputs["q"], inputs["k"], inputs["v"], scale=inputs["scale"],
                  window=inputs["window"], softcap=inputs["softcap"], sinks=inputs["sinks"])


PROBLEM = ModelPrefill
OP_MODULE = "model_op"          # the op side imports torch when loaded
