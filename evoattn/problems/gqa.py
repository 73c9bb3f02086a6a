"""`gqa`: grouped-query / multi-query attention, q (B, Hq, S, D) against k, v (B, Hkv, S, D)."""
from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable

from .base import Config, OpDocs, Problem
from .common import DeviceCache, causal_keep, check_dtype, default_scale, masked_attention, \
    randn, sdpa

if TYPE_CHECKING:
    from .op import OpSpec


def _cfgs(shapes: list[tuple[int, int, int, int, int]]) -> tuple[Config, ...]:
    return tuple({"B": b, "Hq": hq, "Hkv": hkv, "S": s, "D": d, "causal": c}
                 for (b, hq, hkv, s, d) in shapes for c in (False, True))


@functools.lru_cache(maxsize=None)
def _has_enable_gqa() -> bool:
    # Asked once, at the first baseline call (the harness's reference pass, before any guard):
    # afterwards F.scaled_dot_product_attention may be the kernel-only tripwire, whose
    # (*args, **kwargs) signature would say no, and the timed baseline would pay for asking.
    import torch.nn.functional as F
    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):      # a builtin without a signature: read the docstring
        return "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


class Gqa(Problem):
    name = "gqa"
    summary = "grouped-query attention: q (B, Hq, S, D), k/v (B, Hkv, S, D), Hq % Hkv == 0"
    contract = (
        "Compute out[:, h] = softmax(q[:, h] @ k[:, h // G]^T * scale [+ causal mask]) "
        "@ v[:, h // G] with G = Hq // Hkv, for q of shape (B, Hq, S, D) and k, v of shape "
        "(B, Hkv, S, D), contiguous, dtype float16/bfloat16/float32; Hq % Hkv == 0 (Hkv == 1 "
        "is multi-query attention). With causal=True query i attends to keys 0..i. Call: "
        "attention(q, k, v, causal=bool, scale=float). The output has the shape, dtype and "
        "device of q. Must be correct for any S >= 1, D in {64, 128}, any Hq, Hkv with "
        "Hq % Hkv == 0. Inputs must not be modified; do not materialise repeated k/v if you "
        "want to beat the baseline. Accumulate in float32. FLOPs: 4 * B * Hq * S^2 * D, halved "
        "for causal (the sdpa convention). Baselines: PyTorch SDPA with enable_gqa=True, and "
        "repeat_interleave of k/v then SDPA; fitness is the speedup over the faster."
    )
    default_configs = _cfgs([(2, 32, 8, 4096, 64), (2, 32, 1, 4096, 64), (4, 32, 8, 2048, 128)])
    cpu_configs = ({"B": 1, "Hq": 4, "Hkv": 2, "S": 128, "D": 64, "causal": False},
                   {"B": 1, "Hq": 4, "Hkv": 1, "S": 128, "D": 64, "causal": True})
    domain_configs = (
        {"B": 1, "Hq": 6, "Hkv": 2, "S": 77, "D": 64, "causal": True},
        {"B": 2, "Hq": 4, "Hkv": 4, "S": 1000, "D": 128, "causal": False},
        {"B": 1, "Hq": 8, "Hkv": 1, "S": 1, "D": 64, "causal": True},
        {"B": 1, "Hq": 12, "Hkv": 3, "S": 1000, "D": 64, "causal": True},
    )
    cpu_domain_configs = ({"B": 1, "Hq": 6, "Hkv": 2, "S": 77, "D": 64, "causal": True},
                          {"B": 1, "Hq": 2, "Hkv": 2, "S": 33, "D": 128, "causal": False})
    domain = "any B >= 1; Hq % Hkv == 0; any S >= 1; D in {64, 128}; causal or not"
    baseline_name = "the faster of SDPA with enable_gqa=True and repeat_interleave then SDPA"
    baseline_names = ("sdpa_gqa", "repeat_sdpa")
    op_docs = OpDocs(call="attention(q, k, v, causal=True)",
                     replaces="F.scaled_dot_product_attention(q, k, v, is_causal=True, "
                              "enable_gqa=True)",
                     shapes="q: (B, Hq, S, D); k, v: (B, Hkv, S, D), Hq % Hkv == 0",
                     raw_args="True")

    def __init__(self) -> None:
        self._masks = DeviceCache()

    def label(self, cfg: Config) -> str:
        c = " causal" if cfg["causal"] else ""
        return f"({cfg['B']},{cfg['Hq']}/{cfg['Hkv']},{cfg['S']},{cfg['D']}){c}"

    def flops(self, cfg: Config) -> float:
        f = 4.0 * cfg["B"] * cfg["Hq"] * cfg["S"] ** 2 * cfg["D"]
        return f / 2 if cfg["causal"] else f

    def make_inputs(self, cfg: Config, dtype: Any, device: Any, gen: Any) -> dict[str, Any]:
        check_dtype(self, dtype)
        if cfg["Hq"] % cfg["Hkv"]:
            raise ValueError(f"gqa config {cfg}: Hq must be a multiple of Hkv")
        b, s, d = cfg["B"], cfg["S"], cfg["D"]
        q = randn((b, cfg["Hq"], s, d), gen, device, dtype)
        k = randn((b, cfg["Hkv"], s, d), gen, device, dtype)
        v = randn((b, cfg["Hkv"], s, d), gen, device, dtype)
        return {"q": q, "k": k, "v": v, "causal": bool(cfg["causal"]), "scale": default_scale(d)}

    def _keep(self, inputs: dict[str, Any]) -> Any:
        """Returns the (S, S) causal mask for causal inputs (cached), else None."""
        q = inputs["q"]
        return causal_keep(self._masks, q.shape[2], q.device) if inputs["causal"] else None

    def reference(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return masked_attention(inputs["q"], inputs["k"], inputs["v"], inputs["scale"],
                                keep=self._keep(inputs))

    def baseline(self, inputs: dict[str, Any], cfg: Config) -> Any:
        if _has_enable_gqa():
            return sdpa(inputs["q"], inputs["k"], inputs["v"], is_causal=inputs["causal"],
                        scale=inputs["scale"], enable_gqa=True)
        return _repeat_then_sdpa(inputs, cfg)

    def baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        return {"sdpa_gqa": self.baseline, "repeat_sdpa": _repeat_then_sdpa}

    def extra_baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        def naive(inputs: dict[str, Any], cfg: Config) -> Any:
            q = inputs["q"]
            return masked_attention(q, inputs["k"], inputs["v"], inputs["scale"],
                                    keep=self._keep(inputs), compute_dtype=q.dtype)
        return {"naive": naive}

    def call(self, fn: Callable[..., Any], inputs: dict[str, Any], cfg: Config) -> Any:
        return fn(inputs["q"], inputs["k"], inputs["v"], causal=inputs["causal"],
                  scale=inputs["scale"])


def _repeat_then_sdpa(inputs: dict[str, Any], cfg: Config) -> Any:
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    g = q.shape[1] // k.shape[1]
    return sdpa(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1),
                is_causal=inputs["causal"], scale=inputs["scale"])


PROBLEM = Gqa


def op_spec() -> OpSpec:
    """Returns the op's spec: the kernel's contract has k, v with fewer heads already."""
    from .op import causal_spec
    return causal_spec(repeats_kv=False)
