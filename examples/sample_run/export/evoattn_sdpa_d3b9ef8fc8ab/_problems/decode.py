"""`decode`: attention for generation, Sq new queries against a KV cache of per-sequence length.

q (B, Hq, Sq, D) holds the newest Sq tokens of each sequence; k, v (B, Hkv, Smax, D) are the
cache, of which sequence b's first cache_seqlens[b] positions are valid (the new tokens'
keys included, as after appending them). Query i of Sq sits at position L - Sq + i and sees
keys 0 .. L - Sq + i: causal among the new tokens, everything before them. A query that sees
no key (L = 0, or L < Sq for the first L - Sq rows) outputs zeros, as FlashAttention's
`flash_attn_with_kvcache` does.

Decode is bandwidth-bound: a call must read the valid cache once, so `bytes_moved` counts
those bytes (and q and the output); the benchmark reports GB/s against the GPU's memory
bandwidth. The cache past each length is refilled with large random values on every call, so
a kernel that reads past cache_seqlens gets a wrong answer, not a lucky one.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable

from .base import BaselineSetProblem, Config, OpDocs
from .common import check_dtype, default_scale, flops_for_pairs, randn
from .decode_baselines import DecodeBaselines, decode_attention

LENGTH_PATTERNS = ("ragged", "full", "edge")
MAX_SQ = 16
# The cache past each sequence's length holds values this many times larger than the valid
# ones: a key read past the length then tends to dominate its row's softmax (scores of
# standard deviation GARBAGE_SCALE instead of 1), so even an off-by-one read is caught.
GARBAGE_SCALE = 8.0


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """A config's sizes: batch, query and key/value heads, new tokens, cache capacity, head dim."""

    B: int
    Hq: int
    Hkv: int
    Sq: int
    ctx: int                           # Smax: the cache's capacity, and the longest length
    D: int
    lens: str                          # which length pattern (LENGTH_PATTERNS)


def shape_of(cfg: Config) -> DecodeShape:
    """Returns the config's sizes; raises ValueError naming the key that is missing or wrong."""
    missing = [k for k in ("B", "Hq", "Hkv", "Sq", "ctx", "D") if k not in cfg]
    if missing:
        raise ValueError(f"decode config {cfg}: missing key(s) {', '.join(missing)}")
    s = DecodeShape(*(int(cfg[k]) for k in ("B", "Hq", "Hkv", "Sq", "ctx", "D")),
                    str(cfg.get("lens", "ragged")))
    if min(s.B, s.Hq, s.Hkv, s.ctx) < 1 or s.Hq % s.Hkv:
        raise ValueError(f"decode config {cfg}: B, Hq, Hkv, ctx must be >= 1, Hq % Hkv == 0")
    if not 1 <= s.Sq <= MAX_SQ:
        raise ValueError(f"decode config {cfg}: Sq must be in 1..{MAX_SQ}")
    if s.D not in (64, 128):
        raise ValueError(f"decode config {cfg}: D must be 64 or 128")
    if s.lens not in LENGTH_PATTERNS:
        raise ValueError(f"decode config {cfg}: lens must be one of {', '.join(LENGTH_PATTERNS)}")
    return s


def lengths(cfg: Config) -> list[int]:
    """Returns each sequence's cache length, deterministic per config.

    ragged: the first sequence fills the cache (ctx), the others lie in [ctx/2, ctx];
    full: every sequence is ctx long; edge: cycles through 0, 1, Sq - 1, Sq, ctx, ctx - 1 and
    a middle value (the boundaries a kernel gets wrong), then random ones."""
    s = shape_of(cfg)
    rng = random.Random(s.B * 1_000_003 + s.ctx * 131 + s.Sq)
    if s.lens == "full":
        return [s.ctx] * s.B
    if s.lens == "ragged":
        return [s.ctx] + [rng.randint((s.ctx + 1) // 2, s.ctx) for _ in range(s.B - 1)]
    edge = [0, 1, s.Sq - 1, s.Sq, s.ctx, s.ctx - 1, (s.ctx + 1) // 2]
    return [min(s.ctx, max(0, edge[b])) if b < len(edge) else rng.randint(0, s.ctx)
            for b in range(s.B)]


def visible_pairs(lens: list[int], sq: int) -> int:
    """Returns the (query, key) pairs one query head sees: query i of a length-L sequence
    sees max(0, L - Sq + i + 1) keys."""
    return sum(max(0, L - sq + i + 1) for L in lens for i in range(sq))


def _cfg(b: int, hq: int, hkv: int, sq: int, ctx: int, d: int, lens: str = "ragged") -> Config:
    return {"B": b, "Hq": hq, "Hkv": hkv, "Sq": sq, "ctx": ctx, "D": d, "lens": lens}


K = 1024


class Decode(BaselineSetProblem):
    name = "decode"
    summary = ("decode attention: q (B, Hq, Sq<=16, D) against a KV cache (B, Hkv, Smax, D) "
               "with per-sequence lengths")
    contract = (
        "Compute attention for the Sq newest tokens of each sequence against its KV cache. "
        "q is (B, Hq, Sq, D) with 1 <= Sq <= 16; k and v are the cache, (B, Hkv, Smax, D); "
        "cache_seqlens is an int32 tensor (B,) on the same device: sequence b's valid cache is "
        "positions 0 .. L-1 with L = cache_seqlens[b] (0 <= L <= Smax; lengths differ across "
        "the batch, 0 and 1 included), the new tokens' own keys among them. Query i of Sq is "
        "at position L - Sq + i and attends to keys 0 .. L - Sq + i (causal among the new "
        "tokens). Query head h uses key/value head h // (Hq // Hkv) (Hq % Hkv == 0; Hkv == 1 "
        "is multi-query). A query that sees no key (L = 0, or L < Sq) outputs zeros. out = "
        "softmax(q k^T * scale over the visible keys) v. Call: attention(q, k, v, "
        "cache_seqlens, scale=float). q, k, v are contiguous, float16 or bfloat16; the output "
        "has the shape, dtype and device of q. The cache past each length holds garbage "
        "(finite): never read it. Do not synchronise with the host to read the lengths "
        "(a decode step must stay capturable in a CUDA graph) and do not materialise repeated "
        "k/v. Must be correct for any B, Smax >= 1, D in {64, 128}. Inputs must not be "
        "modified. Accumulate in float32. FLOPs: 4 * Hq * D * (visible query-key pairs); "
        "bytes: 2 * sum(cache_seqlens) * Hkv * D * element size for the cache, plus q and the "
        "output (the benchmark reports GB/s). Baselines: SDPA called the way transformers "
        "calls it for a cache (a boolean padding mask built once per step; GQA by packing "
        "the query heads for Sq = 1, repeat_kv otherwise), compiled FlexAttention with a "
        "BlockMask from the lengths, and flash-attn's flash_attn_with_kvcache where "
        "flash-attn is importable; fitness is the speedup over the fastest."
    )
    dtypes = ("float16", "bfloat16")
    default_dtype = "float16"
    # B x ctx x (Hq/Hkv, D) x Sq: batch 1 needs split-KV to fill the GPU; B >= 8 at 8k and
    # more are the bandwidth-bound cases. Ragged lengths are a padded batch (transformers
    # passes SDPA a mask); "full" ones an unpadded generation step, the call the exported
    # package serves in transformers (SDPA takes no mask there: its fastest path). No cache
    # (k and v) is over 1 GiB: the evaluator holds every config's inputs for its trials at
    # once (about 15 GiB in all, 3 trials).
    default_configs = (
        _cfg(1, 32, 8, 1, 1 * K, 64),
        _cfg(1, 32, 8, 1, 8 * K, 64),
        _cfg(1, 32, 8, 1, 32 * K, 64),
        _cfg(1, 8, 1, 4, 32 * K, 128),
        _cfg(8, 32, 8, 4, 1 * K, 64),
        _cfg(8, 32, 8, 1, 8 * K, 64),
        _cfg(8, 8, 1, 1, 8 * K, 128),
        _cfg(8, 32, 8, 1, 32 * K, 128),
        _cfg(16, 32, 8, 1, 8 * K, 64),
        _cfg(1, 32, 8, 1, 8 * K, 64, "full"),
        _cfg(16, 32, 8, 1, 8 * K, 64, "full"),
        _cfg(64, 32, 8, 1, 1 * K, 64),
        _cfg(64, 32, 8, 1, 8 * K, 64),
        _cfg(64, 32, 8, 4, 8 * K, 64),
        _cfg(64, 8, 1, 1, 32 * K, 128),
    )
    cpu_configs = (_cfg(3, 4, 2, 1, 200, 64), _cfg(2, 4, 1, 4, 130, 64))
    domain_configs = (
        _cfg(7, 8, 2, 3, 300, 64, "edge"),
        _cfg(9, 4, 4, 1, 1000, 128, "edge"),
        _cfg(2, 32, 1, 16, 777, 128),              # 512 query rows per key/value head
        _cfg(3, 6, 2, 16, 33, 64, "edge"),
        _cfg(1, 2, 1, 1, 1, 64),
        _cfg(4, 12, 3, 2, 5000, 64),
    )
    cpu_domain_configs = (_cfg(7, 2, 2, 3, 77, 128, "edge"), _cfg(5, 6, 2, 16, 40, 64, "edge"),
                          _cfg(1, 2, 1, 1, 1, 64))
    domain = ("any B >= 1; Hq % Hkv == 0; 1 <= Sq <= 16; any Smax >= 1; any lengths 0..Smax; "
              "D in {64, 128}")
    implausible_speedup = 40.0    # repeat_kv reads the cache Hq/Hkv times: 4-8x is honest
    baseline_name = ("the fastest of SDPA as transformers calls it, compiled FlexAttention and "
                     "flash_attn_with_kvcache (when flash-attn is importable)")
    baseline_names = ("sdpa_hf", "flex", "flash_kvcache")
    op_docs = OpDocs(
        call="attention(q, k, v, cache_seqlens)",
        replaces="an SDPA call over the cache with a padding mask",
        shapes="q: (B, Hq, Sq <= 16, D), the new tokens; k, v: (B, Hkv, Smax, D), the cache; "
               "cache_seqlens: int32 (B,)",
        in_module=False,                 # a decode call needs a cache
        hf_declines="a padding mask, the prefill of a prompt over 16 tokens",
        notes="The kernel serves `generate`'s steps (and up to 16 new tokens at once) over the "
              "dynamic or the static cache of a batch without padding, also compiled "
              "(`generate(..., cache_implementation=\"static\")`); `decode.py` in this "
              "package says which calls. A prompt longer than 16 tokens runs SDPA, or an "
              "exported prefill kernel: `hf.register(prefill=sdpa_package)` hands that "
              "package the calls this kernel does not take (they count in its `stats()`).")
    random_inputs = ("q", "k", "v")           # the lengths are the config's: never refilled

    def __init__(self) -> None:
        self._base = DecodeBaselines()

    def label(self, cfg: Config) -> str:
        s = shape_of(cfg)
        lens = "" if s.lens == "ragged" else f" {s.lens}"
        return f"(B{s.B},{s.Hq}/{s.Hkv},q{s.Sq},{s.ctx},{s.D}){lens}"

    def flops(self, cfg: Config) -> float:
        s = shape_of(cfg)
        return flops_for_pairs(visible_pairs(lengths(cfg), s.Sq), s.Hq, s.D)

    def bytes_moved(self, cfg: Config, elem_bytes: int = 2) -> float:
        s = shape_of(cfg)
        cache = 2 * sum(lengths(cfg)) * s.Hkv * s.D
        q_and_out = 2 * s.B * s.Hq * s.Sq * s.D
        return float((cache + q_and_out) * elem_bytes + 4 * s.B)

    # ---- tensors (child process only) -----------------------------------------------------
    def make_inputs(self, cfg: Config, dtype: Any, device: Any, gen: Any) -> dict[str, Any]:
        import torch
        check_dtype(self, dtype)
        s = shape_of(cfg)
        q = randn((s.B, s.Hq, s.Sq, s.D), gen, device, dtype)
        k = randn((s.B, s.Hkv, s.ctx, s.D), gen, device, dtype)
        v = randn((s.B, s.Hkv, s.ctx, s.D), gen, device, dtype)
        lens = torch.tensor(lengths(cfg), dtype=torch.int32, device=device)
        inputs = {"q": q, "k": k, "v": v, "cache_seqlens": lens, "scale": default_scale(s.D)}
        _scale_tails(inputs)
        return inputs

    def refill(self, inputs: dict[str, Any], gen: Any) -> None:
        for name in self.random_inputs:
            inputs[name].normal_(generator=gen)
        _scale_tails(inputs)

    def reference(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return decode_attention(inputs["q"], inputs["k"], inputs["v"],
                                inputs["cache_seqlens"].tolist(), inputs["scale"])

    def torch_in_dtype(self, inputs: dict[str, Any], cfg: Config) -> Any:
        q = inputs["q"]
        return decode_attention(q, inputs["k"], inputs["v"], inputs["cache_seqlens"].tolist(),
                                inputs["scale"], round_p=q.dtype)

    def baseline(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return self._base.sdpa_hf(inputs, cfg)

    def extra_baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        return {"sdpa_gqa_mask": self._base.sdpa_gqa_mask, "naive": self._base.naive}

    def call(self, fn: Callable[..., Any], inputs: dict[str, Any], cfg: Config) -> Any:
        return fn(inputs["q"], inputs["k"], inputs["v"], inputs["cache_seqlens"],
                  scale=inputs["scale"])


def _scale_tails(inputs: dict[str, Any]) -> None:
    """Multiplies the cache past each sequence's length by GARBAGE_SCALE, in place."""
    import torch
    k, lens = inputs["k"], inputs["cache_seqlens"]
    past = torch.arange(k.shape[2], device=k.device)[None, :] >= lens[:, None].long()
    factor = torch.where(past, GARBAGE_SCALE, 1.0).to(k.dtype)[:, None, :, None]  # (B,1,Smax,1)
    for name in ("k", "v"):
        inputs[name].mul_(factor)


PROBLEM = Decode
OP_MODULE = "decode_op"        # the op side imports torch when loaded
