import torch

def attn(q, k, v, causal=False, scale=None):
    return q
