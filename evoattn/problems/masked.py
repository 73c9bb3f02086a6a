"""`masked`: attention with a user-supplied additive mask (padding, block-sparse, bias).

The mask patterns are deterministic per config and computed in plain Python, so
`flops` can count the visible pairs without building a tensor. No generator
ever produces a fully masked query row (see `_lengths` and `_block_pattern`).
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Callable

from .base import Config, OpDocs, Problem
from .common import NEG_INF, check_dtype, default_scale, flops_for_pairs, masked_attention, \
    randn, sdpa

if TYPE_CHECKING:
    from .op import OpSpec

BLOCK = 64               # block-sparse granularity (rows and columns)
DENSITY = 0.25           # fraction of key blocks kept per query block row
PATTERNS = ("padding", "block", "bias")


def _cfg(b: int, h: int, sq: int, sk: int, d: int, pattern: str) -> Config:
    return {"B": b, "H": h, "Sq": sq, "Sk": sk, "D": d, "pattern": pattern}


def _lengths(cfg: Config) -> list[int]:
    """Returns each batch's key length: spread over [Sk/2, Sk), about 25% padding on average."""
    B, Sk = cfg["B"], cfg["Sk"]
    return [Sk - ((b + 1) * Sk) // (2 * (B + 1)) for b in range(B)]     # each >= ceil(Sk/2) >= 1


def _block_pattern(cfg: Config) -> list[list[int]]:
    """Returns, per query block row, the sorted kept key blocks (>= 1 each, ~DENSITY of them)."""
    nq, nk = -(-cfg["Sq"] // BLOCK), -(-cfg["Sk"] // BLOCK)
    rng = random.Random(cfg["Sq"] * 1_000_003 + cfg["Sk"])
    keep = max(1, round(DENSITY * nk))
    rows = []
    for r in range(nq):
        diag = min(nk - 1, r * nk // nq)          # always kept: no query row is ever empty
        others = rng.sample([c for c in range(nk) if c != diag], keep - 1)
        rows.append(sorted([diag] + others))
    return rows


def visible_pairs_per_head(cfg: Config) -> int:
    """Returns the visible (query, key) pairs summed over the batch, for one head."""
    if cfg["pattern"] == "padding":
        return cfg["Sq"] * sum(_lengths(cfg))
    Sq, Sk = cfg["Sq"], cfg["Sk"]
    total = 0
    for r, cols in enumerate(_block_pattern(cfg)):
        rows = min(Sq, (r + 1) * BLOCK) - r * BLOCK
        total += rows * sum(min(Sk, (c + 1) * BLOCK) - c * BLOCK for c in cols)
    return total * cfg["B"]


class Masked(Problem):
    name = "masked"
    summary = "attention with an additive float mask broadcastable to (B, H, Sq, Sk), -inf = hidden"
    contract = (
        "Compute out = softmax(q @ k^T * scale + mask) @ v for q of shape (B, H, Sq, D), k and "
        "v of shape (B, H, Sk, D), contiguous, dtype float16/bfloat16/float32 (default "
        "float16), and a 4-D additive mask of q's dtype broadcastable to (B, H, Sq, Sk) (each "
        "of its dims is 1 or the full size; it may be a padding mask (B, 1, 1, Sk), a "
        "block-sparse mask (1, 1, Sq, Sk) of 64x64 blocks, or a per-head bias (1, H, Sq, Sk) "
        "with finite values and -inf blocks). Entries are 0, finite values to add, or -inf "
        "(the key is hidden). Every query row has at least one finite entry (the generators "
        "guarantee it; fully masked rows are outside the contract). Call: attention(q, k, v, "
        "mask, scale=float). The output has the shape, dtype and device of q. Anything derived "
        "from the mask (a block bitmap, say) must be computed inside the call, every call: "
        "caching it across calls is not allowed. Inputs must not be modified. Accumulate in "
        "float32. FLOPs count only the visible pairs: 4 * H * D * (number of (b, i, j) with a "
        "finite mask entry). Baselines: PyTorch SDPA with attn_mask (it computes all pairs) and compiled "
        "FlexAttention (a BlockMask of the -inf blocks, built once; the mask added as a "
        "score_mod); fitness is the speedup over the faster."
    )
    default_dtype = "float16"
    op_docs = OpDocs(call="attention(q, k, v, mask)",
                     replaces="F.scaled_dot_product_attention(q, k, v, attn_mask=mask)",
                     shapes="q: (B, H, Sq, D); k, v: (B, H, Sk, D); mask additive, of q's dtype, "
                            "broadcastable to (B, H, Sq, Sk)")
    default_configs = (
        _cfg(2, 32, 4096, 4096, 64, "padding"),
        _cfg(2, 32, 4096, 4096, 64, "block"),
        _cfg(2, 32, 1024, 4096, 64, "padding"),          # cross-attention, Sq != Sk
        _cfg(2, 32, 1024, 4096, 64, "block"),
        _cfg(4, 16, 2048, 2048, 128, "block"),
    )
    cpu_configs = (_cfg(1, 2, 128, 128, 64, "padding"), _cfg(1, 2, 128, 256, 64, "block"))
    domain_configs = (
        _cfg(1, 3, 77, 130, 64, "padding"),
        _cfg(2, 2, 1000, 1000, 128, "block"),
        _cfg(1, 4, 300, 200, 64, "bias"),
        _cfg(1, 1, 1, 64, 64, "padding"),
    )
    cpu_domain_configs = (_cfg(1, 1, 77, 130, 64, "padding"), _cfg(1, 2, 64, 100, 64, "bias"))
    domain = ("any B, H >= 1; any Sq, Sk >= 1; D in {64, 128}; any 4-D additive mask "
              "broadcastable to (B, H, Sq, Sk) with no fully masked row")
    baseline_name = "the fastest of SDPA with the additive attn_mask and compiled FlexAttention"
    baseline_names = ("sdpa_mask", "flex")
    implausible_speedup = 20.0
    random_inputs = ("q", "k", "v")          # the mask is constant: never refilled

    def label(self, cfg: Config) -> str:
        return (f"({cfg['B']},{cfg['H']},{cfg['Sq']}x{cfg['Sk']},{cfg['D']}) "
                f"{cfg['pattern']}")

    def flops(self, cfg: Config) -> float:
        return flops_for_pairs(visible_pairs_per_head(cfg), cfg["H"], cfg["D"])

    def make_mask(self, cfg: Config, dtype: Any, device: Any, gen: Any) -> Any:
        """Returns the additive mask for a config (values of the `bias` pattern come from gen)."""
        import torch
        B, H, Sq, Sk = cfg["B"], cfg["H"], cfg["Sq"], cfg["Sk"]
        pattern = cfg["pattern"]
        if pattern not in PATTERNS:
            raise ValueError(f"masked config {cfg}: pattern must be one of {', '.join(PATTERNS)}")
        if pattern == "padding":
            j = torch.arange(Sk, device=device)
            lens = torch.tensor(_lengths(cfg), device=device)
            keep = (j[None, :] < lens[:, None]).view(B, 1, 1, Sk)
            return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, NEG_INF)
        blocks = torch.zeros(-(-Sq // BLOCK), -(-Sk // BLOCK), dtype=torch.bool)
        for r, cols in enumerate(_block_pattern(cfg)):
            blocks[r, cols] = True
        keep = blocks.repeat_interleave(BLOCK, 0)[:Sq].repeat_interleave(BLOCK, 1)[:, :Sk]
        keep = keep.to(device).view(1, 1, Sq, Sk)
        if pattern == "block":
            base = torch.zeros(keep.shape, dtype=dtype, device=device)
        else:                                   # bias: finite per-head values plus -inf blocks
            base = randn((1, H, Sq, Sk), gen, device, dtype)
        return base.masked_fill(~keep, NEG_INF).contiguous()

    def make_inputs(self, cfg: Config, dtype: Any, device: Any, gen: Any) -> dict[str, Any]:
        check_dtype(self, dtype)
        b, h, d = cfg["B"], cfg["H"], cfg["D"]
        q = randn((b, h, cfg["Sq"], d), gen, device, dtype)
        k = randn((b, h, cfg["Sk"], d), gen, device, dtype)
        v = randn((b, h, cfg["Sk"], d), gen, device, dtype)
        return {"q": q, "k": k, "v": v, "mask": self.make_mask(cfg, dtype, device, gen),
                "scale": default_scale(d)}

    def reference(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return masked_attention(inputs["q"], inputs["k"], inputs["v"], inputs["scale"],
                                bias=inputs["mask"])

    def baseline(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return sdpa(inputs["q"], inputs["k"], inputs["v"], attn_mask=inputs["mask"],
                    scale=inputs["scale"])

    def __init__(self) -> None:
        from .flex import FlexBaseline, additive_mask_pattern
        self._flex = FlexBaseline(additive_mask_pattern, self.random_inputs)

    def baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        return {"sdpa_mask": self.baseline, "flex": self._flex}

    def extra_baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        def naive(inputs: dict[str, Any], cfg: Config) -> Any:
            q = inputs["q"]
            return masked_attention(q, inputs["k"], inputs["v"], inputs["scale"],
                                    bias=inputs["mask"], compute_dtype=q.dtype)
        return {"naive": naive}

    def call(self, fn: Callable[..., Any], inputs: dict[str, Any], cfg: Config) -> Any:
        return fn(inputs["q"], inputs["k"], inputs["v"], inputs["mask"], scale=inputs["scale"])


PROBLEM = Masked


def shape_refusal(a: dict[str, Any]) -> str | None:
    """Returns why an op call is outside the contract (shapes, the mask's dtype), or None."""
    q, k, v, mask = a["q"], a["k"], a["v"], a["mask"]
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or \
            (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        return (f"expected q (B, H, Sq, D), k, v (B, H, Sk, D); got {tuple(q.shape)}, "
                f"{tuple(k.shape)}")
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if mask.dim() != 4 or any(m not in (1, f) for m, f in zip(mask.shape, full)):
        return f"mask {tuple(mask.shape)} is not broadcastable to {full} dim by dim"
    if mask.dtype != q.dtype:
        return f"mask dtype {mask.dtype} differs from q's {q.dtype}"
    return None


def op_spec() -> OpSpec:
    """Returns the op's spec: SDPA with the mask falls back; transformers' unmasked causal
    calls get an explicit causal mask (no padding: its fully masked rows are outside the
    contract)."""
    import torch

    from .op import OpSpec, parse_schema, repeat_kv, scale_of, sdpa_mask
    schema = "(Tensor q, Tensor k, Tensor v, Tensor mask, float? scale=None) -> Tensor"

    def hf_call(attention: Any, q: Any, k: Any, v: Any, mask: Any, scale: float | None,
                window: int | None, causal: bool) -> Any:
        if not causal:
            return None
        S = q.shape[2]
        hidden = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
        additive = torch.zeros(1, 1, S, S, dtype=q.dtype, device=q.device)
        return attention(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]),
                         additive.masked_fill(hidden, float("-inf")), scale=scale)

    return OpSpec(
        schema=schema, params=parse_schema(schema), shape_refusal=shape_refusal,
        call_kernel=lambda fn, q, k, v, mask, scale=None: fn(q, k, v, mask,
                                                             scale=scale_of(q, scale)),
        fallback_for=lambda a: sdpa_mask, flags=lambda a: {}, hf_call=hf_call)
