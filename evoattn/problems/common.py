"""Helpers shared by the attention-variant problems; the strided/sliding_window base class."""
from __future__ import annotations

import math
from typing import Any, Callable

from .base import Config, Problem

NEG_INF = float("-inf")


def randn(shape: tuple[int, ...], gen: Any, device: Any, dtype: Any) -> Any:
    """Returns standard normal values drawn in float32 from `gen`, then cast to `dtype`."""
    import torch
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def check_dtype(problem: Any, dtype: Any) -> None:
    """Raises ValueError when the problem does not support `dtype`."""
    name = str(dtype).replace("torch.", "")
    if name not in problem.dtypes:
        raise ValueError(f"problem {problem.name} supports dtypes {', '.join(problem.dtypes)}, "
                         f"not {name}")


def masked_attention(q: Any, k: Any, v: Any, scale: float, keep: Any = None,
                     bias: Any = None, compute_dtype: Any = None) -> Any:
    """Returns softmax(q kᵀ·scale + bias, masked where `keep` is False) v.

    Computed in `compute_dtype` (float32 by default: the reference). k and v may have fewer
    heads than q (grouped-query): each key head serves Hq // Hkv consecutive query heads.
    """
    import torch
    dt = compute_dtype or torch.float32
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale                   # (B, H, Sq, Sk)
    if bias is not None:
        s = s + bias.to(dt)
    if keep is not None:
        s = s.masked_fill(~keep, NEG_INF)
    p = torch.softmax(s.float(), dim=-1).to(dt)
    return torch.matmul(p, v)


def sdpa(q: Any, k: Any, v: Any, **kw: Any) -> Any:
    """Calls torch's scaled_dot_product_attention (the harness's baselines only)."""
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q, k, v, **kw)


class DeviceCache:
    """Per-process cache of constant tensors (baseline masks) keyed by config and device."""

    def __init__(self) -> None:
        self._items: dict[tuple[Any, ...], Any] = {}

    def get(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        if key not in self._items:
            self._items[key] = make()
        return self._items[key]


def causal_keep(cache: DeviceCache, n: int, device: Any) -> Any:
    """Returns the (n, n) top-left causal mask (query i sees keys 0..i), cached per device."""
    def make() -> Any:
        import torch
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return cache.get(("causal", n, str(device)), make)


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)


def flops_for_pairs(pairs: int, batch_heads: int, d: int) -> float:
    """Returns 4·D FLOPs (q·k and p·v, a multiply-add each) per visible (query, key) pair."""
    return 4.0 * batch_heads * pairs * d


class CausalKeyMaskProblem(Problem):
    """A causal attention problem whose visible keys follow one integer parameter `param` of
    the config (a stride, a window): references, baselines and calls shared by strided and
    sliding_window. Subclasses give `param`, `visible(i, j, p)` on index tensors, and
    `visible_pairs(S, p)`."""

    param = ""

    @staticmethod
    def visible(i: Any, j: Any, p: int) -> Any:
        raise NotImplementedError

    @staticmethod
    def visible_pairs(S: int, p: int) -> int:
        raise NotImplementedError

    baseline_name = "the fastest of SDPA with a boolean mask and compiled FlexAttention"
    baseline_names = ("sdpa_mask", "flex")

    def __init__(self) -> None:
        from .flex import FlexBaseline, FlexPattern
        self._masks = DeviceCache()
        visible = self.visible

        def pattern(inputs: dict[str, Any], cfg: Config) -> FlexPattern:
            p, S = inputs[self.param], inputs["q"].shape[2]
            return FlexPattern(lambda b, h, qi, kv: visible(qi, kv, p), None, None, None, S, S)

        self._flex = FlexBaseline(pattern)

    def label(self, cfg: Config) -> str:
        return f"({cfg['B']},{cfg['H']},{cfg['S']},{cfg['D']}) {self.param} {cfg[self.param]}"

    def flops(self, cfg: Config) -> float:
        return flops_for_pairs(self.visible_pairs(cfg["S"], cfg[self.param]),
                               cfg["B"] * cfg["H"], cfg["D"])

    def keep(self, S: int, p: int, device: Any) -> Any:
        """Returns the (S, S) boolean mask of visible keys (cached per process)."""
        def make() -> Any:
            import torch
            i = torch.arange(S, device=device)[:, None]
            j = torch.arange(S, device=device)[None, :]
            return self.visible(i, j, p)
        return self._masks.get((S, p, str(device)), make)

    def make_inputs(self, cfg: Config, dtype: Any, device: Any, gen: Any) -> dict[str, Any]:
        check_dtype(self, dtype)
        shape = (cfg["B"], cfg["H"], cfg["S"], cfg["D"])
        q, k, v = (randn(shape, gen, device, dtype) for _ in range(3))
        return {"q": q, "k": k, "v": v, self.param: int(cfg[self.param]),
                "scale": default_scale(cfg["D"])}

    def _keep_for(self, inputs: dict[str, Any]) -> Any:
        q = inputs["q"]
        return self.keep(q.shape[2], inputs[self.param], q.device)

    def reference(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return masked_attention(inputs["q"], inputs["k"], inputs["v"], inputs["scale"],
                                keep=self._keep_for(inputs))

    def baseline(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return sdpa(inputs["q"], inputs["k"], inputs["v"], scale=inputs["scale"],
                    attn_mask=self._keep_for(inputs))

    def baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        return {"sdpa_mask": self.baseline, "flex": self._flex}

    def extra_baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        def naive(inputs: dict[str, Any], cfg: Config) -> Any:
            q = inputs["q"]
            return masked_attention(q, inputs["k"], inputs["v"], inputs["scale"],
                                    keep=self._keep_for(inputs), compute_dtype=q.dtype)
        return {"naive": naive}

    def call(self, fn: Callable[..., Any], inputs: dict[str, Any], cfg: Config) -> Any:
        return fn(inputs["q"], inputs["k"], inputs["v"], scale=inputs["scale"],
                  **{self.param: inputs[self.param]})
