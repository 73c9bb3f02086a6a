"""`alibi`: causal attention with ALiBi biases, score(i, j) += -slope_h * (i - j)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .base import Config, OpDocs, Problem
from .common import NEG_INF, DeviceCache, check_dtype, default_scale, randn, sdpa

if TYPE_CHECKING:
    from .op import OpSpec


def slopes(H: int, device: Any) -> Any:
    """Returns ALiBi's slopes 2^(-8(h+1)/H) for h = 0..H-1, float32 (H,)."""
    import torch
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float32,
                        device=device)


def bias(slope: Any, S: int, dtype: Any) -> Any:
    """Returns the (1, H, S, S) additive bias in `dtype`: -slope_h * (i - j), -inf above the
    diagonal (the causal part)."""
    import torch
    i = torch.arange(S, device=slope.device)
    dist = (i[:, None] - i[None, :]).float()                              # i - j
    b = -slope.float().view(-1, 1, 1) * dist                              # (H, S, S)
    return b.masked_fill(dist < 0, NEG_INF).unsqueeze(0).to(dtype)


class Alibi(Problem):
    name = "alibi"
    summary = "causal attention with ALiBi biases: score(i, j) += -slope_h * (i - j)"
    contract = (
        "Compute out = softmax(q @ k^T * scale + bias) @ v for q, k, v of shape (B, H, S, D), "
        "contiguous, float16/bfloat16/float32, causal (query i sees keys 0..i), where "
        "bias[h, i, j] = -slopes[h] * (i - j) for j <= i and slopes is a float32 tensor of "
        "shape (H,) (the ALiBi paper's geometric slopes 2^(-8(h+1)/H) in the benchmark). Call: "
        "attention(q, k, v, slopes, scale=float). The output has q's shape, dtype and device. "
        "Must be correct for any S >= 1, D in {64, 128}. Compute the bias on the fly; do not "
        "modify the inputs. Accumulate in float32. FLOPs: 2 * B * H * S^2 * D (causal). "
        "Baselines: PyTorch SDPA with the bias as a materialised additive float mask (cached "
        "per config, so building it is not timed), and compiled FlexAttention with the bias as "
        "a score_mod; fitness is the speedup over the faster."
    )
    default_configs = ({"B": 2, "H": 32, "S": 4096, "D": 64},
                       {"B": 8, "H": 16, "S": 1024, "D": 128})
    cpu_configs = ({"B": 1, "H": 2, "S": 128, "D": 64},)
    domain_configs = ({"B": 1, "H": 3, "S": 77, "D": 64}, {"B": 1, "H": 2, "S": 1000, "D": 128})
    cpu_domain_configs = ({"B": 1, "H": 3, "S": 45, "D": 64},)
    domain = "any B, H >= 1; any S >= 1; D in {64, 128}; ALiBi slopes of shape (H,)"
    baseline_name = "the faster of SDPA with the bias as a float mask and compiled FlexAttention"
    baseline_names = ("sdpa_bias", "flex")
    op_docs = OpDocs(call="attention(q, k, v, slopes)",
                     replaces="an SDPA call with the ALiBi bias as a float mask",
                     shapes="q, k, v: (B, H, S, D); slopes: float32 (H,); causal")

    def __init__(self) -> None:
        from .flex import FlexBaseline, FlexPattern
        self._bias = DeviceCache()

        def pattern(inputs: dict[str, Any], cfg: Config) -> FlexPattern:
            slope, S = inputs["slopes"], inputs["q"].shape[2]

            def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return kv_idx <= q_idx

            def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return score - slope[h] * (q_idx - kv_idx)
            return FlexPattern(causal, alibi, None, None, S, S)

        self._flex = FlexBaseline(pattern)

    def label(self, cfg: Config) -> str:
        return f"({cfg['B']},{cfg['H']},{cfg['S']},{cfg['D']}) alibi"

    def flops(self, cfg: Config) -> float:
        return 2.0 * cfg["B"] * cfg["H"] * cfg["S"] ** 2 * cfg["D"]

    def make_inputs(self, cfg: Config, dtype: Any, device: Any, gen: Any) -> dict[str, Any]:
        check_dtype(self, dtype)
        shape = (cfg["B"], cfg["H"], cfg["S"], cfg["D"])
        q, k, v = (randn(shape, gen, device, dtype) for _ in range(3))
        return {"q": q, "k": k, "v": v, "slopes": slopes(cfg["H"], device),
                "scale": default_scale(cfg["D"])}

    def _bias_for(self, inputs: dict[str, Any], dtype: Any) -> Any:
        """Returns the config's bias in `dtype`, cached (slopes depend only on H)."""
        slope, S = inputs["slopes"], inputs["q"].shape[2]
        key = (S, str(dtype), str(slope.device), slope.shape[0])
        return self._bias.get(key, lambda: bias(slope, S, dtype))

    def reference(self, inputs: dict[str, Any], cfg: Config) -> Any:
        import torch
        q, k, v = (inputs[n].float() for n in "qkv")
        s = torch.matmul(q, k.transpose(-1, -2)) * inputs["scale"]
        s = s + self._bias_for(inputs, torch.float32)
        return torch.matmul(torch.softmax(s, dim=-1), v)

    def baseline(self, inputs: dict[str, Any], cfg: Config) -> Any:
        q = inputs["q"]
        return sdpa(q, inputs["k"], inputs["v"], scale=inputs["scale"],
                    attn_mask=self._bias_for(inputs, q.dtype))

    def baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        return {"sdpa_bias": self.baseline, "flex": self._flex}

    def extra_baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        def naive(inputs: dict[str, Any], cfg: Config) -> Any:
            import torch
            q, k, v = inputs["q"], inputs["k"], inputs["v"]
            s = torch.matmul(q, k.transpose(-1, -2)) * inputs["scale"]
            s = s + self._bias_for(inputs, q.dtype)
            return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)
        return {"naive": naive}

    def call(self, fn: Callable[..., Any], inputs: dict[str, Any], cfg: Config) -> Any:
        return fn(inputs["q"], inputs["k"], inputs["v"], inputs["slopes"], scale=inputs["scale"])


PROBLEM = Alibi


def op_spec() -> OpSpec:
    """Returns the op's spec: SDPA with the ALiBi bias as an explicit float mask falls back;
    no transformers mapping (its models pass the bias as a mask, which hf.py declines)."""
    import torch

    from .op import OpSpec, parse_schema, same_shape, scale_of, sdpa_mask
    schema = "(Tensor q, Tensor k, Tensor v, Tensor slopes, float? scale=None) -> Tensor"

    def shape_refusal(a: dict[str, Any]) -> str | None:
        q, slope = a["q"], a["slopes"]
        if slope.dtype != torch.float32 or tuple(slope.shape) != (q.shape[1],):
            return f"slopes must be float32 of shape ({q.shape[1]},); got {tuple(slope.shape)}"
        return same_shape(a)

    def fallback(q: Any, k: Any, v: Any, slopes: Any, scale: float | None = None) -> Any:
        return sdpa_mask(q, k, v, bias(slopes, q.shape[2], q.dtype), scale)

    return OpSpec(
        schema=schema, params=parse_schema(schema), shape_refusal=shape_refusal,
        call_kernel=lambda fn, q, k, v, slope, scale=None: fn(q, k, v, slope,
                                                              scale=scale_of(q, scale)),
        fallback_for=lambda a: fallback, flags=lambda a: {})
