"""The hybrid sdpa seed (seeds/sdpa/flash_hybrid.py, a program of several files) without a GPU:
its files and knobs, which knobs run no call, how it routes calls, and how the evaluator builds
and hands over its CUDA companion (a real nvcc, where there is one)."""
from __future__ import annotations

import importlib.util
import warnings
import shutil
from pathlib import Path

import pytest

from evoattn.contract import program, runtime
from evoattn.contract.knobs import active, find_knobs, set_knobs
from evoattn.child.loader import LoadFailure, build_candidate, build_companions
from evoattn.problems import get_problem

ROOT = Path(__file__).resolve().parents[1]
SEEDS = ROOT / "seeds" / "sdpa"
HYBRID = SEEDS / "flash_hybrid.py"
TRITON_SEED = SEEDS / "flash_triton.py"
CUDA_SEED = SEEDS / "wgmma_flash.cu"
ROUTING = {"CUDA_D64", "CUDA_D64_CAUSAL", "CUDA_D128", "CUDA_D128_CAUSAL"}
ROUTING_KNOBS = ROUTING | {"CUDA_D64_SMALL", "CUDA_D64_FILL_KEYS"}
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

# A stand-in for the wgmma source: the same entry point, returning B + 6 without touching CUDA.
STUB_CU = r'''
extern "C" int evoattn_sdpa(const void* q, const void* k, const void* v, void* out, int B,
                            int H, int S, int D, int dtype, int causal, float scale,
                            void* stream) { return B + 6; }
'''


@pytest.fixture()
def hybrid(monkeypatch):  # noqa: ANN001, ANN201
    """A fresh import of the hybrid seed, as a loader with no built library would import it."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location("flash_hybrid_test", HYBRID)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_hybrid_is_its_dispatcher_and_the_two_seeds_unchanged():
    files = program.split(program.read(HYBRID), "unused.py")
    assert files.names == ("flash_hybrid.py", "flash_triton.py", "wgmma_flash.cu",
                           "cuda_core_flash.cuh")
    for name in files.names[1:]:
        assert files.text(name) == (SEEDS / name).read_text(), name
    assert len(HYBRID.read_text().splitlines()) < 230      # a short dispatcher


def test_the_hybrid_carries_both_seeds_knobs_and_its_routing_knobs():
    keys = {k.key for k in find_knobs(program.read(HYBRID))}
    triton = {k.name for k in find_knobs(TRITON_SEED.read_text())}
    cuda = {k.name for k in find_knobs(CUDA_SEED.read_text())}
    shared = triton & cuda                        # e.g. BLOCK_N_D64: qualified by their file
    assert shared
    assert keys == (ROUTING_KNOBS | {n if n not in shared else f"flash_triton.py:{n}" for n in triton}
                    | {n if n not in shared else f"wgmma_flash.cu:{n}" for n in cuda})


def test_the_mutator_leaves_the_knobs_of_kernels_that_run_no_call():
    source = program.read(HYBRID)
    knobs = find_knobs(source)
    keys = {k.key for k in knobs}
    in_cuda = {k.key for k in knobs if k.file == "wgmma_flash.cu"}
    in_triton = {k.key for k in knobs if k.file == "flash_triton.py"}

    def dead(src: str, target: str) -> set[str]:
        return keys - {k.key for k in active(find_knobs(src), {"target": target})}

    triton_d128 = {k for k in in_triton if "D128" in k}
    cuda_d64 = {k for k in in_cuda if k.endswith("_D64")}
    # the defaults on an H100/H200: D=128 runs CUDA, D=64 both (calls that fill the GPU CUDA)
    assert dead(source, "sm90") == triton_d128
    # without the filling calls D=64 runs Triton only: the CUDA kernel's D=64 knobs go dead
    no_fill = set_knobs(source, {"CUDA_D64_FILL_KEYS": "0"})
    assert dead(no_fill, "sm90") == triton_d128 | cuda_d64
    # elsewhere every call runs Triton: every CUDA and routing knob is dead; on the CPU also
    # the Triton knobs whose code only a GPU runs (TMA, warp specialisation, the fast launch)
    assert dead(source, "sm80") == in_cuda | ROUTING_KNOBS
    gpu_only = {"USE_TMA", "WARP_SPECIALIZE", "FAST_LAUNCH"}
    assert dead(source, "cpu") == in_cuda | ROUTING_KNOBS | gpu_only
    # routing D=64 to CUDA too: every Triton knob goes dead on an H100/H200
    all_cuda = set_knobs(source, {"CUDA_D64": "True", "CUDA_D64_CAUSAL": "True"})
    assert dead(all_cuda, "sm90") == in_triton
    # the small head-dim-64 calls to CUDA, the large ones still on Triton: both kernels' D=64
    # knobs are live
    small_cuda = set_knobs(no_fill, {"CUDA_D64_SMALL": "4194304"})
    assert dead(small_cuda, "sm90") == triton_d128
    # D=64 on the cp.async path: the warp-specialised path's D=64 knobs (its consumer
    # warpgroups, ring depth and q tiles) go dead with it; D=128's stay live
    cp_async64 = set_knobs(source, {"WARP_SPECIALIZE_D64": "0"})
    assert dead(cp_async64, "sm90") == triton_d128 | {"WIDE_D64", "WS_STAGES_D64",
                                                      "Q_DOUBLE_MAX_S_D64", "SPLIT_TAIL_D64"}
    cp_async128 = set_knobs(source, {"WARP_SPECIALIZE_D128": "0"})
    assert dead(cp_async128, "sm90") == triton_d128 | {"WS_STAGES_D128", "Q_DOUBLE_MAX_S_D128"}
    # causal D=128 calls on Triton: the CUDA kernel's causal order (sections) goes dead, its
    # non-causal order stays live; non-causal ones on Triton: the other way round
    order128 = {"HEAD_MAJOR_D128", "SECTION_MB_D128"}
    no_causal128 = set_knobs(source, {"CUDA_D128_CAUSAL": "False"})
    assert dead(no_causal128, "sm90") & order128 == {"SECTION_MB_D128"}
    no_plain128 = set_knobs(source, {"CUDA_D128": "False"})
    assert dead(no_plain128, "sm90") & order128 == {"HEAD_MAJOR_D128"}
    # the split of the last wave serves non-causal D=64 calls on a persistent grid: dead when no
    # such call takes the CUDA kernel, or its grid is not persistent
    assert "SPLIT_TAIL_D64" not in dead(source, "sm90")
    assert "SPLIT_TAIL_D64" in dead(set_knobs(source, {"CUDA_D64_FILL_KEYS": "0"}), "sm90")
    assert "SPLIT_TAIL_D64" in dead(set_knobs(source, {"PERSISTENT_D64": "0"}), "sm90")


def test_routing_sends_only_sm90_half_precision_calls_whose_knob_is_set(hybrid, monkeypatch):
    import torch
    monkeypatch.setattr(hybrid, "_is_sm90", lambda device: True)
    monkeypatch.setattr(hybrid._triton, "_interpreting", lambda: False)
    monkeypatch.setattr(hybrid, "_cuda_entry", lambda: object())
    cuda, f16 = torch.device("cuda"), torch.float16
    for d64, d64c, d128, d128c in [(True, False, False, True), (False, True, True, False)]:
        for name, value in zip(sorted(ROUTING), (d128, d128c, d64, d64c)):
            monkeypatch.setattr(hybrid, name, value)
        assert [hybrid._cuda_wanted(cuda, f16, 64, False), hybrid._cuda_wanted(cuda, f16, 64, True),
                hybrid._cuda_wanted(cuda, f16, 128, False),
                hybrid._cuda_wanted(cuda, f16, 128, True)] == [d64, d64c, d128, d128c]
    assert hybrid._cuda_wanted(cuda, f16, 64, False, small=True)         # CUDA_D64_SMALL
    assert not hybrid._cuda_wanted(cuda, f16, 128, True, small=True)    # head dim 64 only
    monkeypatch.setattr(hybrid, "CUDA_D64", True)
    assert hybrid._cuda_wanted(cuda, torch.bfloat16, 64, False)
    assert not hybrid._cuda_wanted(cuda, torch.float32, 64, False)        # float32: Triton
    assert not hybrid._cuda_wanted(torch.device("cpu"), f16, 64, False)   # the CPU
    assert not hybrid._cuda_wanted(cuda, f16, 96, False)                  # no kernel for D=96
    monkeypatch.setattr(hybrid, "_is_sm90", lambda device: False)         # an A100, a B200
    assert not hybrid._cuda_wanted(cuda, f16, 64, False)
    monkeypatch.setattr(hybrid, "_is_sm90", lambda device: True)
    monkeypatch.setattr(hybrid._triton, "_interpreting", lambda: True)    # TRITON_INTERPRET=1
    assert not hybrid._cuda_wanted(cuda, f16, 64, False)


def test_views_and_grouped_kv_take_the_strided_cuda_call_only_where_it_reads_them(hybrid,
                                                                               monkeypatch):
    """transformers' (B, S, H, D) views and k, v with fewer heads go to the CUDA kernel's strided
    entry (where the build and GPU take them), dense inputs to its dense one; strides or
    pointers TMA cannot read, broadcast k/v, other key lengths and head counts that do not
    divide stay on Triton."""
    import torch
    ready = {"ok": True}
    monkeypatch.setattr(hybrid, "_strided_entry", lambda device, d: object() if ready["ok"] else None)
    monkeypatch.setattr(hybrid, "_route", lambda q, k, causal: True)
    calls = []
    monkeypatch.setattr(hybrid, "_cuda_call",
                        lambda q, causal, scale, k=None, v=None: calls.append(k is not None))

    def bshd(B, H, S, D=64):  # noqa: ANN001, ANN202
        return torch.randn(B, S, H, D, dtype=torch.float16).transpose(1, 2)

    q, k, v = bshd(2, 8, 33), bshd(2, 2, 33), bshd(2, 2, 33)
    assert hybrid._viewable(q, k, v)
    dense = torch.randn(2, 8, 33, 64, dtype=torch.float16)
    assert hybrid._viewable(dense, dense[:, :4].contiguous(), dense[:, :4].contiguous())
    hybrid._cuda_for(q, k, v, True, 0.1)
    hybrid._cuda_for(dense, dense, dense, True, 0.1)
    assert calls == [True, False]                  # strided, then dense
    flat = torch.empty(2 * 8 * 33 * 64 + 1, dtype=torch.float16)
    shifted = flat[1:].view(2, 8, 33, 64)          # 2 bytes past an aligned address
    padded = torch.randn(2, 8, 33, 66, dtype=torch.float16)[..., :64]   # rows 132 bytes apart
    bad = [(shifted, k, v), (padded, k, v), (q, k[:, :1].expand(2, 2, 33, 64), v),
           (q, bshd(2, 2, 40), bshd(2, 2, 40)), (q, bshd(2, 3, 33), bshd(2, 3, 33)),
           (q, k, bshd(2, 2, 33).float())]
    assert [hybrid._viewable(*t) for t in bad] == [False] * len(bad)
    assert hybrid._cuda_for(*bad[0], False, 0.1) is None and len(calls) == 2
    ready["ok"] = False                            # a build whose head dim is not warp-specialised
    assert not hybrid._viewable(q, k, v)


def test_a_strided_call_tells_the_entry_its_outputs_strides_without_allocating_them(hybrid,
                                                                                   monkeypatch):
    """The output call() makes (torch.empty_like(q)) lies as q does; _cuda_call passes its
    strides to the strided entry, found once per layout without making a tensor."""
    import torch
    monkeypatch.setattr(hybrid, "_strided_entry", lambda device, d: object())
    for name in ("_cuda_getDevice", "_cuda_getCurrentRawStream"):   # absent from CPU builds
        monkeypatch.setattr(torch._C, name, lambda *a: 0, raising=False)
    q = torch.randn(2, 33, 8, 64, dtype=torch.float16).transpose(1, 2)     # (B, S, H, D) storage
    k = v = torch.randn(2, 33, 2, 64, dtype=torch.float16).transpose(1, 2)
    made = []
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like",
                        lambda t, *a, **kw: made.append(t.device.type) or real(t, *a, **kw))
    hybrid._out_strides.cache_clear()
    for _ in range(3):
        call = hybrid._cuda_call(q, True, 0.1, k, v)
    assert made == ["meta"]                        # the first call's layout, then cached
    strides = list(call.__defaults__[-1])          # the array call() hands the entry
    assert strides == [*q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                       *real(q).stride()[:3]]
    assert real(q).stride() == q.stride()          # a dense view: the output mirrors it
    padded = torch.randn(2, 33, 8, 80, dtype=torch.float16)[..., :64].transpose(1, 2)
    assert hybrid._out_strides(padded.shape, padded.stride()) == real(padded).stride()


def test_without_a_built_library_cuda_calls_run_triton_after_one_warning(hybrid, monkeypatch):
    import torch
    monkeypatch.setattr(hybrid, "_is_sm90", lambda device: True)
    monkeypatch.setattr(hybrid._triton, "_interpreting", lambda: False)
    with pytest.warns(RuntimeWarning, match="wgmma_flash.cu is not built.*run Triton"):
        assert not hybrid._cuda_wanted(torch.device("cuda"), torch.float16, 128, False)
    with warnings.catch_warnings():                                # once only
        warnings.simplefilter("error")
        assert not hybrid._cuda_wanted(torch.device("cuda"), torch.float16, 128, True)


def _program_with_stub(tmp: Path, routing: dict[str, str] | None = None) -> Path:
    """The hybrid's files in tmp, with the wgmma source replaced by the stub (and knobs set)."""
    source = program.read(HYBRID)
    files = dict(program.split(set_knobs(source, routing or {}), "x").files)
    files["wgmma_flash.cu"] = STUB_CU
    return program.write(program.join(list(files.items())), tmp, "x")


@needs_nvcc
def test_the_evaluator_builds_the_cuda_companion_once_and_hands_it_over(tmp_path, monkeypatch):
    (tmp_path / "prog").mkdir()
    main = _program_with_stub(tmp_path / "prog")
    cache = tmp_path / "cache"
    libs, log, cached, _ = build_companions(main, main.read_text(), cache, 120, "sm_90a",
                                            "sm90")
    assert set(libs) == {"wgmma_flash.cu"} and cached is False
    import ctypes
    assert ctypes.CDLL(libs["wgmma_flash.cu"]).evoattn_sdpa(None, None, None, None, 3, 1, 1, 64,
                                                            0, 0, ctypes.c_float(1.0), None) == 9

    def no_nvcc(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("nvcc ran for a cached companion")
    monkeypatch.setattr(runtime, "_run_group", no_nvcc)
    again, _, cached, _ = build_companions(main, main.read_text(), cache, 120, "sm_90a",
                                           "sm90")
    assert again == libs and cached is True


def test_the_cuda_companion_is_not_built_where_no_call_would_run_it(tmp_path, monkeypatch):
    def no_nvcc(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("nvcc ran")
    monkeypatch.setattr(runtime, "_run_group", no_nvcc)
    (tmp_path / "a").mkdir()
    main = _program_with_stub(tmp_path / "a")
    for target in (None, "sm80"):                 # no GPU; a GPU other than an H100/H200
        assert build_companions(main, main.read_text(), tmp_path, 60, "sm_80",
                                target)[0] == {}
    (tmp_path / "b").mkdir()                      # routing knobs all off: no call runs CUDA
    off = _program_with_stub(tmp_path / "b", {**{k: "False" for k in ROUTING},
                                              "CUDA_D64_FILL_KEYS": "0"})
    assert build_companions(off, off.read_text(), tmp_path, 60, "sm_90a", "sm90")[0] == {}


@needs_nvcc
def test_a_broken_cuda_companion_is_a_build_error_naming_it(tmp_path):
    (tmp_path / "p").mkdir()
    main = _program_with_stub(tmp_path / "p")
    (main.parent / "wgmma_flash.cu").write_text(STUB_CU.replace("return B + 6;", "return oops;"))
    with pytest.raises(LoadFailure) as info:
        build_companions(main, main.read_text(), tmp_path / "cache", 120, "sm_90a", "sm90")
    assert info.value.kind == "build" and info.value.reason.startswith("wgmma_flash.cu:")
    assert "oops" in info.value.log


def test_on_the_cpu_the_hybrid_loads_without_its_cuda_companion(tmp_path, monkeypatch):
    """build_candidate on a machine without a GPU: nothing is built, the module still loads."""
    pytest.importorskip("torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (tmp_path / "p").mkdir()
    main = program.write(program.read(HYBRID), tmp_path / "p", "x")
    loaded = build_candidate(main, get_problem("sdpa"), tmp_path / "cache", 60, None)()
    assert loaded.form == "python" and loaded.build_cached is None


@needs_nvcc
def test_the_real_cuda_companion_builds_with_the_header_it_includes(tmp_path):
    """wgmma_flash.cu includes cuda_core_flash.cuh, a companion of the hybrid's: the build puts
    the companion headers on the include path."""
    (tmp_path / "p").mkdir()
    main = program.write(program.read(HYBRID), tmp_path / "p", "x")
    libs, log, _, _ = build_companions(main, main.read_text(), tmp_path / "cache", 600,
                                       "sm_90a", "sm90")
    assert set(libs) == {"wgmma_flash.cu"} and Path(libs["wgmma_flash.cu"]).is_file(), log


def _route_flags(hybrid, monkeypatch, flag: str) -> list[bool]:  # noqa: ANN001
    """The `flag` ('small' or 'fills') of each route the hybrid decides from now on (every
    call then runs a stand-in for Triton)."""
    seen: list[bool] = []
    monkeypatch.setattr(hybrid, "_cuda_wanted",
                        lambda device, dtype, d, causal, small=False, fills=False:
                        seen.append({"small": small, "fills": fills}[flag]) or False)
    monkeypatch.setattr(hybrid._triton, "attention", lambda *args: None)
    return seen


def test_the_small_call_route_counts_a_calls_work(hybrid, monkeypatch):
    """CUDA_D64_SMALL compares B·H·Sq·Sk with its threshold (decided once per route key)."""
    import torch
    seen = _route_flags(hybrid, monkeypatch, "small")
    monkeypatch.setattr(hybrid, "CUDA_D64_SMALL", 8 * 512 * 512)
    for B in (1, 2):
        x = torch.empty(B, 8, 512, 64)
        hybrid.attention(x, x, x)
    assert seen == [True, False]


def test_the_fill_route_takes_calls_that_give_every_sm_a_work_item(hybrid, monkeypatch):
    """CUDA_D64_FILL_KEYS: at most that many keys and a 128-row item per SM, causal or not."""
    import torch
    seen = _route_flags(hybrid, monkeypatch, "fills")
    monkeypatch.setattr(hybrid._triton, "_num_sms", lambda device: 132)
    monkeypatch.setattr(hybrid, "CUDA_D64_FILL_KEYS", 1024)
    calls = [((8, 32, 512), False, True),      # 1024 items of 128 rows, 512 keys
             ((8, 32, 512), True, True),       # causal too
             ((4, 32, 1024), False, True),
             ((2, 32, 2048), True, False),     # more keys than CUDA_D64_FILL_KEYS
             ((1, 8, 512), False, False),      # 32 items for 132 SMs
             ((1, 8, 512), True, False),
             ((1, 33, 512), False, True)]      # 132 items
    for (B, H, S), causal, _ in calls:
        hybrid._ROUTES.clear()
        x = torch.empty(B, H, S, 64)
        hybrid.attention(x, x, x, causal=causal)
    assert seen == [want for _, _, want in calls]
    # the route is kept per key, and `fills` is part of it: the filling call's twin asks nothing
    hybrid.attention(*(torch.empty(1, 33, 512, 64),) * 3)      # fills, as the last call
    assert len(seen) == len(calls)
    hybrid.attention(*(torch.empty(1, 32, 512, 64),) * 3)      # 128 items: a key of its own
    assert seen[len(calls):] == [False]
