"""Class 5 (library attention): calls an ATen attention op by name on torch.ops.aten."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def attention(q, k, v, causal=False, scale=None):
    op = getattr(torch.ops.aten, "_scaled_dot_" + "product_flash_attention_for_cpu")
    return op(q, k, v, 0.0, causal, scale=scale)[0]
