"""A user-defined evoattn problem: attention with logit soft-capping (Gemma 2).

score = cap * tanh(q·k * scale / cap), then a causal softmax. `evoattn eval seed.py
--problem examples/softcap/problem.py`. See examples/README.md for the names this file
must define; everything here runs as trusted harness code.
"""
import math

NAME = "softcap"
SUMMARY = "causal attention with tanh logit soft-capping: score = cap * tanh(q·k·scale / cap)"
CONTRACT = (
    "Compute out = softmax(cap * tanh(q @ k^T * scale / cap) + causal mask) @ v for q, k, v "
    "of shape (B, H, S, D), contiguous, float16/bfloat16/float32, where query i sees keys "
    "0..i and cap > 0 is a float (Gemma 2 uses 50.0 for attention logits; the benchmark "
    "uses cap = 5.0 with inputs scaled so the cap matters). Call: attention(q, k, v, "
    "softcap=float, scale=float). The output has q's shape, dtype and device. Do not modify "
    "the inputs. Accumulate in float32. FLOPs: 2 * B * H * S^2 * D (causal; the tanh is not "
    "counted). Baselines: the same formula in eager PyTorch (matmul, tanh, masked_fill, "
    "softmax, matmul), since SDPA has no soft-capping, and compiled FlexAttention with the "
    "cap as a score_mod; fitness is the speedup over the faster."
)
CONFIGS = [{"B": 2, "H": 32, "S": 4096, "D": 64, "cap": 5.0},
           {"B": 8, "H": 16, "S": 1024, "D": 128, "cap": 50.0}]
CPU_CONFIGS = [{"B": 1, "H": 2, "S": 128, "D": 64, "cap": 5.0}]
DOMAIN_CONFIGS = [{"B": 1, "H": 3, "S": 77, "D": 64, "cap": 1.0}]
CPU_DOMAIN_CONFIGS = [{"B": 1, "H": 1, "S": 45, "D": 64, "cap": 1.0}]
TOLERANCE = {"factor": 2.0, "floor": 1e-5}
DTYPES = ["float16", "bfloat16", "float32"]
DEFAULT_DTYPE = "float16"
ENTRY = "attention"
random_inputs = ("q", "k", "v")
BASELINE_NAME = "eager torch (matmul, tanh, softmax, matmul)"


def _scores(q, k, scale, cap):
    import torch
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = cap * torch.tanh(s / cap)
    n = q.shape[2]
    above = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    return s.masked_fill(above, float("-inf"))


def make_inputs(cfg, dtype, device, gen):
    import torch
    shape = (cfg["B"], cfg["H"], cfg["S"], cfg["D"])
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
               for _ in range(3))
    # A larger scale than 1/sqrt(D) makes raw logits of size ~4, so a cap of 5 is active.
    return {"q": q, "k": k, "v": v, "softcap": float(cfg["cap"]),
            "scale": 4.0 / math.sqrt(cfg["D"])}


def reference(inputs, cfg):
    import torch
    q, k, v = (inputs[n].float() for n in "qkv")
    s = _scores(q, k, inputs["scale"], inputs["softcap"])
    return torch.matmul(torch.softmax(s, dim=-1), v)


def baseline(inputs, cfg):
    import torch
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    s = _scores(q, k, inputs["scale"], inputs["softcap"])
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)


def mask_mod(inputs, cfg):
    """The causal pattern, as FlexAttention's mask_mod (gives the `flex` baseline)."""
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    return causal


def score_mod(inputs, cfg):
    """The soft-cap of a (scaled) score, as FlexAttention's score_mod."""
    import torch
    cap = float(inputs["softcap"])

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap


def call(fn, inputs, cfg):
    return fn(inputs["q"], inputs["k"], inputs["v"], softcap=inputs["softcap"],
              scale=inputs["scale"])


def flops(cfg):
    return 2.0 * cfg["B"] * cfg["H"] * cfg["S"] ** 2 * cfg["D"]
