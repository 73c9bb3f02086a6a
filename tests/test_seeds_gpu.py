"""The problem-family seeds on a GPU, where the interpreter cannot go: B*H past 65535 (a grid's
second axis limit) and, for the TMA seeds, a misaligned view (TMA needs 16-byte aligned bases)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(rel: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(Path(rel).stem + "_gpu", ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ref(q, k, v, scale, causal=False, bias=None):  # noqa: ANN001, ANN202
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.float()
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(~s.new_ones(n, n, dtype=bool).tril(), float("-inf"))
    return (s.softmax(-1) @ v.float())


@pytest.fixture(scope="module")
def torch():  # noqa: ANN201
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("seed", ["seeds/gqa/gqa_triton.py", "seeds/masked/masked_triton.py",
                                  "seeds/strided/strided_triton.py",
                                  "seeds/sliding_window/window_triton.py"])
def test_more_heads_than_a_grid_axis_holds(torch, seed: str) -> None:  # noqa: ANN001
    B, H, S, D = 2049, 32, 3, 64                     # B*H = 65568 > 65535
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.float16)
               for _ in range(3))
    mod = _load(seed)
    if "gqa" in seed:
        out, ref = mod.attention(q, k, v, causal=True, scale=0.125), _ref(q, k, v, 0.125, True)
    elif "masked" in seed:
        mask = torch.zeros(B, 1, 1, S, device="cuda", dtype=torch.float16)
        mask[::2, ..., -1] = float("-inf")
        out, ref = mod.attention(q, k, v, mask, 0.125), _ref(q, k, v, 0.125, bias=mask)
    else:                                             # stride 1 / window S: plain causal
        out, ref = mod.attention(q, k, v, 1 if "strided" in seed else S, scale=0.125), \
            _ref(q, k, v, 0.125, True)
    torch.cuda.synchronize()
    assert (out.float() - ref).abs().max().item() < 4e-3


@pytest.mark.gpu
def test_mha_with_more_batch_heads_than_a_grid_axis_holds(torch) -> None:  # noqa: ANN001
    mod = _load("seeds/mha/fused_triton.py")
    qkv = torch.randn(8200, 2, 3 * 64, device="cuda")   # B*n_head = 65600
    y = mod.causal_attention(qkv, 8)
    B, T = qkv.shape[:2]
    q, k, v = (t.view(B, T, 8, 8).transpose(1, 2) for t in qkv.split(64, dim=2))
    ref = _ref(q, k, v, 8 ** -0.5, True).transpose(1, 2).reshape(B, T, 64)
    assert (y - ref).abs().max().item() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("seed", ["seeds/gqa/gqa_triton.py", "seeds/masked/masked_triton.py"])
def test_a_misaligned_view_takes_the_pointer_path(torch, seed: str) -> None:  # noqa: ANN001
    B, H, S, D = 1, 2, 130, 64
    n = B * H * S * D

    def view():  # noqa: ANN202  (contiguous, but starting 2 bytes past an aligned address)
        return torch.randn(n + 1, device="cuda", dtype=torch.float16)[1:].view(B, H, S, D)
    q, k, v = view(), view(), view()
    assert q.data_ptr() % 16 != 0
    mod = _load(seed)
    if "gqa" in seed:
        out, ref = mod.attention(q, k, v, causal=False, scale=0.125), _ref(q, k, v, 0.125)
    else:
        mask = torch.zeros(1, 1, 1, S, device="cuda", dtype=torch.float16)
        out, ref = mod.attention(q, k, v, mask, 0.125), _ref(q, k, v, 0.125, bias=mask)
    torch.cuda.synchronize()
    assert (out.float() - ref).abs().max().item() < 4e-3


@pytest.mark.gpu
def test_the_prepared_triton_launch_never_takes_inputs_it_was_not_prepared_for(torch) -> None:  # noqa: ANN001
    """flash_triton prepares a launch per shape on its first call; a transposed (non-contiguous)
    or 8-byte-offset (misaligned) input of that shape must take the ordinary path, not it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ft_prepared", ROOT / "seeds/sdpa/flash_triton.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for B, H, S, D, causal in [(2, 4, 300, 64, True), (2, 4, 300, 128, False)]:
        base = [torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3)]
        mod.attention(*base, causal)
        assert mod._LAUNCHES, "no launch was prepared"
        t = [torch.randn(B, S, H, D, device="cuda", dtype=torch.float16).transpose(1, 2)
             for _ in range(3)]
        off = [torch.randn(B * H * S * D + 4, device="cuda", dtype=torch.float16)[4:]
               .view(B, H, S, D) for _ in range(3)]
        for args in (t, off, [x.clone() for x in base]):
            out = mod.attention(*args, causal)
            s = (args[0].double() @ args[1].double().transpose(-1, -2)) * D ** -0.5
            if causal:
                s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device="cuda").triu(1),
                                  float("-inf"))
            ref = torch.softmax(s, -1) @ args[2].double()
            assert (out.double() - ref).abs().max().item() < 4e-3


@pytest.mark.gpu
def test_the_raw_launch_encodes_each_address_once_and_reads_fresh_values(torch) -> None:  # noqa: ANN001
    """The prepared TMA launch goes beneath Triton's wrapper (Triton 3.6 here) and keeps one
    encoded descriptor per operand address: new values written at a known address are read,
    not an earlier call's."""
    import importlib.util

    import triton
    spec = importlib.util.spec_from_file_location("ft_raw", ROOT / "seeds/sdpa/flash_triton.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    B, H, S, D = 1, 8, 512, 64

    def check(q, k, v) -> None:  # noqa: ANN001
        out = mod.attention(q, k, v, True)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                               is_causal=True)
        assert (out.float() - ref).abs().max().item() < 4e-3

    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    check(q, k, v)
    launch = next(iter(mod._LAUNCHES.values()))
    if triton.__version__.startswith("3.6"):
        assert launch.raw is not None
    for _ in range(3):
        check(q, k, v)
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
    assert launch.raw is None or 4 <= len(launch.maps) <= 8   # q, k, v once; out's few

