"""The hybrid sdpa seed (seeds/sdpa/flash_hybrid.py) without a GPU: that it is the two seeds it
is generated from, how it routes calls, and its nvcc build (a real nvcc, where there is one)."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from evoattn.mutators.knobs import active, find_knobs, set_knobs

ROOT = Path(__file__).resolve().parents[1]
HYBRID = ROOT / "seeds" / "sdpa" / "flash_hybrid.py"
TRITON_SEED = ROOT / "seeds" / "sdpa" / "flash_triton.py"
CUDA_SEED = ROOT / "seeds" / "sdpa" / "wgmma_flash.cu"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

# A stand-in for the wgmma source: the same entry point, returning B + 6 without touching CUDA.
STUB_CU = r'''
extern "C" int evoattn_sdpa(const void* q, const void* k, const void* v, void* out, int B,
                            int H, int S, int D, int dtype, int causal, float scale,
                            void* stream) { return B + 6; }
'''


@pytest.fixture()
def hybrid(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    """A fresh import of the hybrid seed, building into tmp_path."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    spec = importlib.util.spec_from_file_location("flash_hybrid_test", HYBRID)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture()
def builds(hybrid, monkeypatch):  # noqa: ANN001, ANN201
    """The nvcc builds the hybrid runs (real ones): each command line that writes an output."""
    seen = []
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if "-o" in cmd:
            seen.append(cmd)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(hybrid.subprocess, "run", run)
    return seen


def test_hybrid_is_generated_from_the_current_seeds():
    proc = subprocess.run([sys.executable, str(ROOT / "seeds" / "compose_hybrid.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_hybrid_carries_both_seeds_knobs_and_its_routing_knobs():
    hybrid = {k.name: k for k in find_knobs(HYBRID.read_text())}
    triton = find_knobs(TRITON_SEED.read_text())
    cuda = find_knobs(CUDA_SEED.read_text())
    assert len(hybrid) == len(find_knobs(HYBRID.read_text())), "a knob name appears twice"
    for k in triton:
        assert (hybrid[k.name].value, hybrid[k.name].choices) == (k.value, k.choices), k.name
    for k in cuda:
        assert (hybrid["WG_" + k.name].value, hybrid["WG_" + k.name].choices) == \
            (k.value, k.choices), k.name
    routing = {"CUDA_D64", "CUDA_D64_CAUSAL", "CUDA_D128", "CUDA_D128_CAUSAL"}
    assert set(hybrid) == {k.name for k in triton} | {"WG_" + k.name for k in cuda} | routing


def test_embedded_cuda_source_is_the_wgmma_seed_with_its_knobs_renamed(hybrid):
    names = [k.name for k in find_knobs(CUDA_SEED.read_text())]
    # the hybrid marks its knob lines with when(...) conditions (see the next test)
    source = re.sub(r"(// evoattn: choice\([^)]*\))(?: when\([^)]*\))+", r"\1",
                    hybrid._CUDA_SOURCE)
    for name in names:
        assert not re.search(rf"(?<!WG_)\b{name}\b", source), f"{name} left unrenamed"
        source = re.sub(rf"\bWG_{name}\b", name, source)
    assert source == "\n" + CUDA_SEED.read_text()      # r"""<newline> opens the string


def test_the_mutator_leaves_the_knobs_of_kernels_that_run_no_call():
    knobs = find_knobs(HYBRID.read_text())
    names = {k.name for k in knobs}

    def dead(src: str, target: str) -> set[str]:
        return names - {k.name for k in active(find_knobs(src), {"target": target})}

    source = HYBRID.read_text()
    triton_d128 = {n for n in names if "D128" in n and not n.startswith(("WG_", "CUDA_"))}
    wg_d64 = {n for n in names if n.startswith("WG_") and n.endswith("_D64")}
    # the defaults on an H100/H200: D=128 runs CUDA, D=64 Triton
    assert dead(source, "sm90") == triton_d128 | wg_d64
    # elsewhere every call runs Triton: every CUDA and routing knob is dead, no Triton one
    off = {n for n in names if n.startswith(("WG_", "CUDA_"))}
    assert dead(source, "sm80") == off and dead(source, "cpu") == off
    # routing D=64 to CUDA too: every Triton knob of D=64, and the shared ones, go dead
    all_cuda = set_knobs(source, {"CUDA_D64": "True", "CUDA_D64_CAUSAL": "True"})
    assert dead(all_cuda, "sm90") == {n for n in names if not n.startswith(("WG_", "CUDA_"))}


def test_routing_sends_only_sm90_half_precision_calls_whose_knob_is_set(hybrid, monkeypatch):
    import torch
    monkeypatch.setattr(hybrid, "_is_sm90", lambda device: True)
    monkeypatch.setattr(hybrid, "_interpreting", lambda: False)

    def fake(D, dtype=torch.float16, device="cuda"):  # noqa: ANN001, ANN202
        return types.SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(1, 2, 8, D))

    for d64, d64c, d128, d128c in [(True, False, False, True), (False, True, True, False)]:
        monkeypatch.setattr(hybrid, "CUDA_D64", d64)
        monkeypatch.setattr(hybrid, "CUDA_D64_CAUSAL", d64c)
        monkeypatch.setattr(hybrid, "CUDA_D128", d128)
        monkeypatch.setattr(hybrid, "CUDA_D128_CAUSAL", d128c)
        assert [hybrid._cuda_wanted(fake(64), False), hybrid._cuda_wanted(fake(64), True),
                hybrid._cuda_wanted(fake(128), False), hybrid._cuda_wanted(fake(128), True)] == \
            [d64, d64c, d128, d128c]
    monkeypatch.setattr(hybrid, "CUDA_D64", True)
    assert hybrid._cuda_wanted(fake(64, torch.bfloat16), False)
    assert not hybrid._cuda_wanted(fake(64, torch.float32), False)      # float32: Triton
    assert not hybrid._cuda_wanted(fake(64, device="cpu"), False)       # the CPU
    assert not hybrid._cuda_wanted(fake(96), False)                     # no CUDA kernel for D=96
    monkeypatch.setattr(hybrid, "_is_sm90", lambda device: False)       # an A100, a B200
    assert not hybrid._cuda_wanted(fake(64), False)
    monkeypatch.setattr(hybrid, "_is_sm90", lambda device: True)
    monkeypatch.setattr(hybrid, "_interpreting", lambda: True)          # TRITON_INTERPRET=1
    assert not hybrid._cuda_wanted(fake(64), False)


@needs_nvcc
def test_cuda_path_is_built_once_then_loaded_from_the_cache(hybrid, monkeypatch, tmp_path,
                                                            builds):
    monkeypatch.setattr(hybrid, "_CUDA_SOURCE", STUB_CU)
    entry = hybrid._cuda_entry()
    assert entry(None, None, None, None, 3, 1, 1, 64, 0, 0, 1.0, None) == 9
    assert len(builds) == 1 and "-gencode=arch=compute_90a,code=sm_90a" in builds[0]
    hybrid._cuda_entry.cache_clear()                    # a new process: the disk cache serves
    assert hybrid._cuda_entry()(None, None, None, None, 5, 1, 1, 64, 0, 0, 1.0, None) == 11
    assert len(builds) == 1
    entries = list((tmp_path / "ext").iterdir())
    assert [p.name.startswith("flash_hybrid_") for p in entries] == [True]


@needs_nvcc
def test_a_cuda_build_error_is_a_clear_error_and_leaves_no_cache_entry(hybrid, monkeypatch,
                                                                      tmp_path):
    monkeypatch.setattr(hybrid, "_CUDA_SOURCE", STUB_CU.replace("return B + 6;", "return oops;"))
    with pytest.raises(RuntimeError, match="nvcc failed on the CUDA path(.|\n)*oops"):
        hybrid._cuda_entry()
    assert list((tmp_path / "ext").iterdir()) == []


def _no_nvcc(hybrid, monkeypatch):  # noqa: ANN001, ANN202
    monkeypatch.setattr(hybrid.shutil, "which", lambda name: None)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(hybrid, "_NVCC_FALLBACKS", ())


def test_without_nvcc_cuda_calls_run_triton_after_one_warning(hybrid, monkeypatch):
    import torch
    _no_nvcc(hybrid, monkeypatch)
    monkeypatch.setattr(hybrid, "_is_sm90", lambda device: True)
    monkeypatch.setattr(hybrid, "_interpreting", lambda: False)
    q = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float16, shape=(1, 2, 8, 128))
    with pytest.warns(RuntimeWarning, match="no nvcc.*run the Triton kernel"):
        assert not hybrid._cuda_wanted(q, False)
    with pytest.raises(RuntimeError, match="needs nvcc.*CUDA_D\\* knobs to False"):
        hybrid._cuda_entry()                            # called directly, it says what to do


@needs_nvcc
def test_a_failed_build_is_raised_again_without_rebuilding(hybrid, monkeypatch, builds):
    monkeypatch.setattr(hybrid, "_CUDA_SOURCE", STUB_CU.replace("return B + 6;", "return oops;"))
    for _ in range(3):
        with pytest.raises(RuntimeError, match="nvcc failed"):
            hybrid._cuda_kernel()
    assert len(builds) == 1


@needs_nvcc
def test_a_cache_entry_without_its_library_is_rebuilt(hybrid, monkeypatch, tmp_path):
    monkeypatch.setattr(hybrid, "_CUDA_SOURCE", STUB_CU)
    hybrid._cuda_entry()
    (entry,) = (tmp_path / "ext").iterdir()
    (entry / "lib.so").unlink()                         # e.g. a cache cleaned half-way
    hybrid._cuda_entry.cache_clear()
    assert hybrid._cuda_entry()(None, None, None, None, 1, 1, 1, 64, 0, 0, 1.0, None) == 7
    assert (entry / "lib.so").is_file()
