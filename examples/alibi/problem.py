"""A user-defined evoattn problem: causal attention with ALiBi position biases.

`evoattn eval seeds/alibi/alibi_triton.py --problem examples/alibi/problem.py` (the built-in
`alibi` problem's seed serves this file too). See examples/README.md for the names this file
must define; everything here runs as trusted harness code.
"""
import math

NAME = "alibi"
SUMMARY = "causal attention with ALiBi biases: score(i, j) += -slope_h * (i - j)"
CONTRACT = (
    "Compute out = softmax(q @ k^T * scale + bias) @ v for q, k, v of shape (B, H, S, D), "
    "contiguous, float16/bfloat16/float32, causal (query i sees keys 0..i), where "
    "bias[h, i, j] = -slopes[h] * (i - j) for j <= i and slopes is a float32 tensor of shape "
    "(H,) (the ALiBi paper's geometric slopes 2^(-8(h+1)/H) in the benchmark). Call: "
    "attention(q, k, v, slopes, scale=float). The output has q's shape, dtype and device. "
    "Compute the bias on the fly; do not modify the inputs. Accumulate in float32. "
    "FLOPs: 2 * B * H * S^2 * D (causal). Baselines: PyTorch SDPA with the bias as a "
    "materialised additive float mask (cached per config, so building it is not timed), and "
    "compiled FlexAttention with the bias as a score_mod; fitness is the speedup over the "
    "faster."
)
CONFIGS = [{"B": 2, "H": 32, "S": 4096, "D": 64}, {"B": 8, "H": 16, "S": 1024, "D": 128}]
CPU_CONFIGS = [{"B": 1, "H": 2, "S": 128, "D": 64}]
DOMAIN_CONFIGS = [{"B": 1, "H": 3, "S": 77, "D": 64}, {"B": 1, "H": 2, "S": 1000, "D": 128}]
CPU_DOMAIN_CONFIGS = [{"B": 1, "H": 3, "S": 45, "D": 64}]
TOLERANCE = {"factor": 2.0, "floor": 1e-5}
DTYPES = ["float16", "bfloat16", "float32"]
DEFAULT_DTYPE = "float16"
ENTRY = "attention"
random_inputs = ("q", "k", "v")
BASELINE_NAME = "sdpa with an additive bias mask"

_bias_cache = {}


def slopes(H, device):
    """Returns ALiBi's slopes 2^(-8(h+1)/H) for h = 0..H-1, float32."""
    import torch
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float32,
                        device=device)


def _bias(slope, S, dtype):
    """Returns the (1, H, S, S) additive bias in `dtype`, -inf above the diagonal (cached)."""
    import torch
    key = (S, str(dtype), str(slope.device), slope.shape[0])   # slopes depend only on H
    if key not in _bias_cache:
        i = torch.arange(S, device=slope.device)
        dist = (i[:, None] - i[None, :]).float()                          # i - j
        b = -slope.view(-1, 1, 1) * dist                                  # (H, S, S)
        b = b.masked_fill(dist < 0, float("-inf"))
        _bias_cache[key] = b.unsqueeze(0).to(dtype)
    return _bias_cache[key]


def make_inputs(cfg, dtype, device, gen):
    import torch
    shape = (cfg["B"], cfg["H"], cfg["S"], cfg["D"])
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
               for _ in range(3))
    return {"q": q, "k": k, "v": v, "slopes": slopes(cfg["H"], device),
            "scale": 1.0 / math.sqrt(cfg["D"])}


def reference(inputs, cfg):
    import torch
    q, k, v = (inputs[n].float() for n in "qkv")
    s = torch.matmul(q, k.transpose(-1, -2)) * inputs["scale"]
    s = s + _bias(inputs["slopes"], q.shape[2], torch.float32)
    return torch.matmul(torch.softmax(s, dim=-1), v)


def baseline(inputs, cfg):
    import torch.nn.functional as F
    q = inputs["q"]
    return F.scaled_dot_product_attention(q, inputs["k"], inputs["v"], scale=inputs["scale"],
                                          attn_mask=_bias(inputs["slopes"], q.shape[2], q.dtype))


def extra_baselines():
    def naive(inputs, cfg):
        import torch
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        s = torch.matmul(q, k.transpose(-1, -2)) * inputs["scale"]
        s = s + _bias(inputs["slopes"], q.shape[2], q.dtype)
        return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)
    return {"naive": naive}


def mask_mod(inputs, cfg):
    """The causal pattern, as FlexAttention's mask_mod (gives the `flex` baseline)."""
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    return causal


def score_mod(inputs, cfg):
    """The ALiBi bias of a (scaled) score, as FlexAttention's score_mod."""
    slopes = inputs["slopes"]

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)
    return alibi


def call(fn, inputs, cfg):
    return fn(inputs["q"], inputs["k"], inputs["v"], inputs["slopes"], scale=inputs["scale"])


def flops(cfg):
    return 2.0 * cfg["B"] * cfg["H"] * cfg["S"] ** 2 * cfg["D"]
