"""`model_decode`: the generation step of Gemma 2, GPT-OSS, Mistral and Llama over a KV cache.

The `decode` problem's cache contract (q (B, H, T, D) holds each sequence's newest T tokens;
k, v (B, Hkv, Smax, D) are the cache, sequence b's first cache_seqlens[b] positions valid,
the new tokens' keys among them; query t sits at position L - T + t, causal among the new
tokens; a query that sees no key outputs zeros; garbage past each length) with the `model`
problem's features: a left sliding window (key j visible to the query at position p iff
p - W < j <= p), logit soft-capping on the scaled scores before the mask, and attention sinks
(one float32 logit per query head joining each row's softmax denominator). D up to 256.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .base import BaselineSetProblem, Config, Tolerance
from .common import check_dtype, default_scale, flops_for_pairs, randn
from .decode import LENGTH_PATTERNS, MAX_SQ, _scale_tails
from .decode import lengths as _decode_lengths
from .model_prefill import DOMINANT_SINK, HEAD_DIMS, visible

KEYS = ("B", "H", "Hkv", "T", "ctx", "D", "window", "softcap", "sinks")
OPTIONAL_KEYS = ("lens", "scale")    # lens: "ragged" unless given; scale 0 or absent: 1/sqrt(D)
DOMAIN = (f"any B >= 1, ctx (Smax) >= 1, lengths 0..ctx; 1 <= T <= {MAX_SQ}; H % Hkv == 0; "
          "D in {64, 128, 256}; window >= 0 (0: none); softcap >= 0 (0: none); sinks or not")


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """A config's sizes and features (window 0: none; softcap 0.0: none)."""

    B: int
    H: int
    Hkv: int
    T: int                             # new tokens per sequence
    ctx: int                           # Smax: the cache's capacity, and the longest length
    D: int
    window: int
    softcap: float
    sinks: bool
    lens: str                          # the length pattern (decode's LENGTH_PATTERNS)
    scale: float


def shape_of(cfg: Config) -> DecodeShape:
    """Returns the config's shape; raises ValueError naming the key that is missing or wrong."""
    missing = [k for k in KEYS if k not in cfg]
    unknown = [k for k in cfg if k not in KEYS + OPTIONAL_KEYS]
    if missing or unknown:
        what = (f"missing key(s) {', '.join(missing)}" if missing
                else f"unknown key(s) {', '.join(unknown)}")
        raise ValueError(f"model_decode config {cfg}: {what}")
    B, H, Hkv, T, ctx, D, window = (int(cfg[k]) for k in KEYS[:7])
    lens = str(cfg.get("lens", "ragged"))
    bad = {"B": B < 1, "ctx": ctx < 1, "T": not 1 <= T <= MAX_SQ, "window": window < 0,
           "softcap": float(cfg["softcap"]) < 0, "H": H < 1 or Hkv < 1 or H % Hkv != 0,
           "D": D not in HEAD_DIMS, "lens": lens not in LENGTH_PATTERNS,
           "scale": float(cfg.get("scale", 0.0)) < 0}
    for key, wrong in bad.items():
        if wrong:
            raise ValueError(f"model_decode config {cfg}: {key} is outside the contract "
                             f"({DOMAIN}; lens one of {', '.join(LENGTH_PATTERNS)})")
    scale = float(cfg.get("scale", 0.0)) or default_scale(D)
    return DecodeShape(B, H, Hkv, T, ctx, D, window, float(cfg["softcap"]), bool(cfg["sinks"]),
                       lens, scale)


def lengths(cfg: Config) -> list[int]:
    """Returns each sequence's cache length: the `decode` problem's for the same B, T, ctx and
    pattern (its head counts and head dim do not enter)."""
    s = shape_of(cfg)
    return _decode_lengths({"B": s.B, "Hq": 1, "Hkv": 1, "Sq": s.T, "ctx": s.ctx, "D": 64,
                            "lens": s.lens})


def seen_keys(L: int, T: int, t: int, window: int) -> int:
    """Returns how many keys new token t of a length-L sequence sees."""
    n = max(0, L - T + t + 1)
    return min(n, window) if window > 0 else n


def decode_attention(q: Any, k: Any, v: Any, lens: list[int], scale: float, window: int,
                     softcap: float, sinks: Any, round_p: Any = None) -> Any:
    """Returns the float32 answer, one sequence at a time over its valid prefix (no repeated
    k/v: the G query heads of a key/value head times T tokens are the rows of one matmul).

    With `round_p` (a dtype) the unnormalised probabilities are rounded to it before P·V and
    the output is returned in it: a flash kernel's rounding, which sets the tolerance."""
    import torch
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    out = torch.zeros(B, H, T, D, dtype=torch.float32, device=q.device)
    tok = torch.arange(T, device=q.device).repeat(G)                  # row g*T + t -> t
    sink = None
    if sinks is not None:
        sink = sinks.float().reshape(Hkv, G, 1).expand(Hkv, G, T).reshape(Hkv, G * T, 1)
    for b, L in enumerate(lens):
        if L == 0:
            continue
        qb = q[b].float().reshape(Hkv, G * T, D)                      # (Hkv, G*T, D)
        kb, vb = k[b, :, :L].float(), v[b, :, :L].float()             # (Hkv, L, D)
        s = torch.matmul(qb, kb.transpose(-1, -2)) * scale            # (Hkv, G*T, L)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        keep = visible((L - T + tok)[:, None], torch.arange(L, device=q.device)[None, :],
                       window)                                        # (G*T, L)
        s = s.masked_fill(~keep, float("-inf"))
        m = s.amax(-1, keepdim=True)
        if sink is not None:
            m = torch.maximum(m, sink)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)        # rows with no key
        p = torch.exp(s - m)                                          # 0 where hidden
        den = p.sum(-1, keepdim=True)
        if sink is not None:
            den = den + torch.exp(sink - m) * keep.any(-1, keepdim=True)
        if round_p is not None:
            p = p.to(round_p).float()
        o = torch.matmul(p, vb) / torch.where(den > 0, den, torch.ones_like(den))
        out[b] = o.reshape(H, T, D)
    return out if round_p is None else out.to(round_p)


def _cfg(b: int, h: int, hkv: int, t: int, ctx: int, d: int, window: int = 0,
         softcap: float = 0.0, sinks: bool = False, lens: str = "ragged") -> Config:
    return {"B": b, "H": h, "Hkv": hkv, "T": t, "ctx": ctx, "D": d, "window": window,
            "softcap": softcap, "sinks": sinks, "lens": lens}


K = 1024
# Gemma-2-2B (8/4 heads of 256, softcap 50, a 4096 window on alternate layers) and GPT-OSS-20B
# (64/8 heads of 64, sinks, a 128 window on alternate layers), one generation step: (B, T, ctx,
# window). "full": an unpadded batch, what transformers hands an attention function; ragged:
# a padded one. No cache (k and v) is over 1 GiB: the evaluator holds every config's inputs
# for its trials at once.
GEMMA2_2B = tuple(_cfg(b, 8, 4, t, ctx, 256, w, 50.0, False, lens)
                  for b, t, ctx, w, lens in ((1, 1, 16 * K, 0, "full"), (8, 1, 4 * K, 0, "ragged"),
                                             (16, 1, 8 * K, 0, "full"),
                                             (1, 1, 16 * K, 4096, "full"),
                                             (8, 1, 8 * K, 4096, "ragged"),
                                             (4, 4, 8 * K, 0, "ragged"),
                                             (1, 16, 16 * K, 4096, "full")))
GPT_OSS_20B = tuple(_cfg(b, 64, 8, t, ctx, 64, w, 0.0, True, lens)
                    for b, t, ctx, w, lens in ((1, 1, 16 * K, 0, "full"),
                                               (1, 1, 16 * K, 128, "full"),
                                               (8, 1, 4 * K, 0, "ragged"),
                                               (8, 1, 4 * K, 128, "ragged"),
                                               (16, 1, 1 * K, 128, "full"),
                                               (4, 4, 8 * K, 128, "ragged"),
                                               (1, 16, 16 * K, 0, "full")))


class ModelDecode(BaselineSetProblem):
    name = "model_decode"
    summary = ("decode over a KV cache (1-16 new tokens, per-sequence lengths) with GQA, an "
               "optional sliding window, logit softcap and sinks (Gemma 2, GPT-OSS)")
    no_op_reason = ("its op and transformers route are not built yet: an exported `model` "
                    "package leaves decode steps to the model's own attention, counted")
    contract = (
        "Compute attention for the T newest tokens of each sequence against its KV cache. q is "
        f"(B, H, T, D) with 1 <= T <= {MAX_SQ}; k and v are the cache, (B, Hkv, Smax, D); "
        "cache_seqlens is an int32 tensor (B,) on q's device: sequence b's valid cache is "
        "positions 0 .. L-1, L its entry of cache_seqlens (0 <= L <= Smax, lengths differ "
        "across the batch), the new tokens' own keys among them. New token t is at position p ="
        " L - T + t and sees key j iff j <= p and, with window W > 0, j > p - W (transformers' "
        "sliding window: its last W keys, itself included). Query head h uses key/value head h "
        "// (H // Hkv). Scores s = q k^T * scale (1/sqrt(D) unless given); with softcap > 0, s "
        "= softcap * tanh(s / softcap) before the mask. With sinks, a float32 tensor (H,), a "
        "row of head h is sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sink_h)) over its visible j, "
        "sink_h the sinks' entry h. A query that sees no key (p < 0) outputs zeros. Call: "
        "attention(q, k, v, cache_seqlens, scale=float, window=int, softcap=float, sinks=Tensor"
        " or None), window 0 and softcap 0.0 meaning none. q, k, v are contiguous, float16 or "
        "bfloat16; the output has the shape, dtype and device of q. The cache past each length "
        "holds finite garbage: never read it. Do not synchronise with the host to read the "
        "lengths (a decode step must stay capturable in a CUDA graph) and do not materialise "
        f"repeated k/v. Must be correct for {DOMAIN}. Inputs must not be modified. Accumulate in"
        " float32. FLOPs: 4 * H * D * (visible query-key pairs); bytes: the visible cache (each"
        " sequence's last min(L, W + T - 1) keys with a window) in k and v, plus q and the "
        "output. Baselines, as transformers calls them over a cache sliced to the longest "
        "length: its eager path (additive mask, softcap, sinks concatenated), FlexAttention (a "
        "BlockMask from the lengths and window built once per config, softcap score_mod, sinks "
        "by the log-sum-exp), SDPA with a boolean mask (timed only without softcap and sinks) "
        "and flash-attn's flash_attn_with_kvcache(window_size=, softcap=) where importable "
        "(timed only without sinks); fitness is the speedup over the fastest. Shapes outside "
        "the contract must raise ValueError."
    )
    dtypes = ("float16", "bfloat16")
    default_dtype = "bfloat16"
    default_configs = GEMMA2_2B + GPT_OSS_20B
    cpu_configs = (_cfg(3, 2, 1, 1, 200, 256, 16, 5.0), _cfg(2, 4, 2, 4, 130, 64, 0, 0.0, True))
    domain_configs = (
        _cfg(7, 8, 2, 3, 300, 64, 0, 0.0, False, "edge"),    # lengths 0, 1, T - 1, T, ...
        _cfg(7, 4, 1, 16, 500, 128, 1, 0.0, True, "edge"),   # window 1: itself and the sink
        _cfg(2, 8, 4, 16, 777, 256, 100, 2.0),               # an active cap, D=256, T=16
        _cfg(3, 4, 2, 2, 300, 64, 1000, 1.0, True),          # window larger than the cache
        _cfg(1, 2, 1, 1, 1, 64, 0, 5.0, True),               # one key
        _cfg(4, 64, 8, 4, 2000, 64, 128, 0.0, True),         # GPT-OSS's heads, 128 rows a group
    )
    cpu_domain_configs = (_cfg(7, 2, 1, 3, 77, 64, 5, 0.0, True, "edge"),
                          _cfg(7, 4, 2, 16, 40, 128, 1, 1.0, False, "edge"),
                          _cfg(2, 2, 2, 2, 30, 256, 100, 2.0, True))
    domain = DOMAIN
    tolerance = Tolerance(factor=2.0, floor=1e-5)
    implausible_speedup = 60.0   # a 128-of-16k window: eager reads and scores the whole cache
    baseline_name = ("the fastest of transformers' eager path, FlexAttention, SDPA with a mask "
                     "(no softcap, no sinks) and flash_attn_with_kvcache (when importable)")
    baseline_names = ("eager", "flex_attention", "sdpa", "flash_kvcache")
    random_inputs = ("q", "k", "v")   # the lengths are the config's, the sinks the model's

    def __init__(self) -> None:
        from .model_decode_baselines import ModelDecodeBaselines
        self._base = ModelDecodeBaselines()

    def label(self, cfg: Config) -> str:
        s = shape_of(cfg)
        feats = [f"w{s.window}" if s.window else "", f"cap{s.softcap:g}" if s.softcap else "",
                 "sinks" if s.sinks else "", "" if s.lens == "ragged" else s.lens]
        return (f"(B{s.B},{s.H}/{s.Hkv},t{s.T},{s.ctx},{s.D}) "
                + (" ".join(f for f in feats if f) or "causal"))

    def parse_configs(self, spec: str) -> list[Config]:
        """Parses `--configs` text, each config checked against the contract here, so a wrong
        one is a usage error, not a candidate's crash."""
        configs = super().parse_configs(spec)
        for cfg in configs:
            shape_of(cfg)
        return configs

    def flops(self, cfg: Config) -> float:
        s = shape_of(cfg)
        pairs = sum(seen_keys(L, s.T, t, s.window) for L in lengths(cfg) for t in range(s.T))
        return flops_for_pairs(pairs, s.H, s.D)

    def bytes_moved(self, cfg: Config, elem_bytes: int = 2) -> float:
        s = shape_of(cfg)
        keys = sum(min(L, s.window + s.T - 1) if s.window else L for L in lengths(cfg))
        q_and_out = 2 * s.B * s.H * s.T * s.D
        return float((2 * keys * s.Hkv * s.D + q_and_out) * elem_bytes + 4 * s.B)

    # ---- tensors (child process only) -----------------------------------------------------
    def make_inputs(self, cfg: Config, dtype: Any, device: Any, gen: Any) -> dict[str, Any]:
        import torch
        check_dtype(self, dtype)
        s = shape_of(cfg)
        q = randn((s.B, s.H, s.T, s.D), gen, device, dtype)
        k = randn((s.B, s.Hkv, s.ctx, s.D), gen, device, dtype)
        v = randn((s.B, s.Hkv, s.ctx, s.D), gen, device, dtype)
        sinks = None
        if s.sinks:
            sinks = randn((s.H,), gen, device, torch.float32)
            sinks[0] = DOMINANT_SINK
        lens = torch.tensor(lengths(cfg), dtype=torch.int32, device=device)
        inputs = {"q": q, "k": k, "v": v, "cache_seqlens": lens, "sinks": sinks,
                  "window": s.window, "softcap": s.softcap, "scale": s.scale}
        _scale_tails(inputs)
        return inputs

    def refill(self, inputs: dict[str, Any], gen: Any) -> None:
        for name in self.random_inputs:
            inputs[name].normal_(generator=gen)
        _scale_tails(inputs)

    def reference(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return decode_attention(inputs["q"], inputs["k"], inputs["v"],
                                inputs["cache_seqlens"].tolist(), inputs["scale"],
                                inputs["window"], inputs["softcap"], inputs["sinks"])

    def torch_in_dtype(self, inputs: dict[str, Any], cfg: Config) -> Any:
        q = inputs["q"]
        return decode_attention(q, inputs["k"], inputs["v"], inputs["cache_seqlens"].tolist(),
                                inputs["scale"], inputs["window"], inputs["softcap"],
                                inputs["sinks"], round_p=q.dtype)

    def baseline(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return self._base.eager(inputs, cfg)

    def extra_baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        def naive(inputs: dict[str, Any], cfg: Config) -> Any:
            return self.torch_in_dtype(inputs, cfg)
        return {"naive": naive}

    def call(self, fn: Callable[..., Any], inputs: dict[str, Any], cfg: Config) -> Any:
        return fn(inputs["q"], inputs["k"], inputs["v"], inputs["cache_seqlens"],
                  scale=inputs["scale"], window=inputs["window"], softcap=inputs["softcap"],
                  sinks=inputs["sinks"])


PROBLEM = ModelDecode
