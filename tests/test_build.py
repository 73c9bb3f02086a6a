"""Tests for evoattn.contract.runtime: flags, cache keys, conditions, log trimming, and real nvcc builds."""
from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from evoattn.contract import runtime
from evoattn.contract.runtime import (BuildResult, LoadError, build_fast, cache_key, fast_flags,
                               gencode_flags, load_fast, torch_arch_list, trim_log)

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

ARCH = "sm_90a"

TINY = r"""
#include <cuda_runtime.h>
__global__ void copy_kernel(const float* a, float* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) b[i] = a[i] * %s;
}
extern "C" int evoattn_sdpa(const void* q, const void* k, const void* v, void* out, int B,
                            int H, int S, int D, int dtype, int causal, float scale,
                            void* stream) {
  int n = B * H * S * D;
  copy_kernel<<<(n + 127) / 128, 128, 0, (cudaStream_t)stream>>>((const float*)q, (float*)out, n);
  return (int)cudaGetLastError();
}
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


# ---- pure functions (no nvcc) ----------------------------------------------------

def test_gencode_flags_name_the_arch_specific_target_explicitly():
    assert gencode_flags("sm_90a") == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert gencode_flags("sm_86") == ["-gencode=arch=compute_86,code=sm_86"]
    with pytest.raises(ValueError):
        gencode_flags("hopper")


def test_torch_arch_list_converts_sm_names():
    assert torch_arch_list("sm_90a") == "9.0a"
    assert torch_arch_list("sm_100a") == "10.0a"
    assert torch_arch_list("sm_86") == "8.6"


def test_fast_flags_never_use_fast_math():
    flags = fast_flags(ARCH)
    assert "--use_fast_math" not in flags and "-use_fast_math" not in flags
    assert "-O3" in flags and "-lineinfo" in flags


def test_cache_key_changes_with_arch_source_kind_and_toolchain():
    src = TINY.encode()
    base = cache_key(src, "fast", "sm_90a", fast_flags("sm_90a"), "tc1")
    assert base == cache_key(src, "fast", "sm_90a", fast_flags("sm_90a"), "tc1")
    assert base != cache_key(src, "fast", "sm_80", fast_flags("sm_80"), "tc1")
    assert base != cache_key(src, "fast", "sm_80", fast_flags("sm_90a"), "tc1")
    assert base != cache_key(src + b" ", "fast", "sm_90a", fast_flags("sm_90a"), "tc1")
    assert base != cache_key(src, "extension", "sm_90a", fast_flags("sm_90a"), "tc1")
    assert base != cache_key(src, "fast", "sm_90a", fast_flags("sm_90a"), "tc2")


def test_trim_log_puts_errors_first_and_respects_the_limit():
    noise = [f"note: line {i} of chatter that nobody needs to read" for i in range(300)]
    text = "\n".join(noise[:200] + ["kernel.cu(42): error: identifier \"x\" is undefined",
                                    "    x = 1;", "    ^"] + noise[200:])
    out = trim_log(text, limit=1000)
    assert len(out) <= 1000
    assert out.splitlines()[0] == "kernel.cu(42): error: identifier \"x\" is undefined"
    assert "    x = 1;" in out
    assert out.endswith("more lines trimmed]")


def test_trim_log_keeps_a_short_log_whole():
    assert trim_log("a\nb error\nc\n") == "a\nb error\nc"


def test_load_fast_rejects_a_symbol_with_no_known_signature(tmp_path):
    with pytest.raises(KeyError):
        load_fast(str(tmp_path / "lib.so"), "no_such_entry")


def test_load_fast_reports_an_unloadable_library_as_load_error(tmp_path):
    bogus = _write(tmp_path, "lib.so", "not an ELF file")
    with pytest.raises(LoadError):
        load_fast(str(bogus), "evoattn_sdpa")


def test_missing_source_is_a_failed_build_not_an_exception(tmp_path):
    r = build_fast(tmp_path / "absent.cu", tmp_path / "cache", ARCH, 60)
    assert isinstance(r, BuildResult) and not r.ok and "cannot read source" in r.log


# ---- real nvcc builds ------------------------------------------------------------

@needs_nvcc
def test_build_then_cache_hit_without_running_nvcc(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    src = _write(tmp_path, "tiny.cu", TINY % "2.0f")
    first = build_fast(src, cache, ARCH, 120)
    assert first.ok, first.log
    assert not first.cached and Path(first.path).is_file()

    def no_nvcc(*a, **kw):
        raise AssertionError("nvcc ran for a cached build")
    monkeypatch.setattr(runtime, "_run_group", no_nvcc)
    second = build_fast(src, cache, ARCH, 120)
    assert second.ok and second.cached and second.path == first.path
    assert not [e for e in _entries(cache) if e.startswith(".tmp-")]


@needs_nvcc
def test_built_library_exports_the_typed_entry_point(tmp_path):
    src = _write(tmp_path, "tiny.cu", TINY % "3.0f")
    r = build_fast(src, tmp_path / "cache", ARCH, 120)
    assert r.ok, r.log
    fn = load_fast(r.path, "evoattn_sdpa")
    assert fn.restype is ctypes.c_int and len(fn.argtypes) == 12
    assert fn.argtypes[10] is ctypes.c_float


@needs_nvcc
def test_changed_source_rebuilds_into_a_new_entry(tmp_path):
    cache = tmp_path / "cache"
    a = build_fast(_write(tmp_path, "a.cu", TINY % "2.0f"), cache, ARCH, 120)
    b = build_fast(_write(tmp_path, "b.cu", TINY % "4.0f"), cache, ARCH, 120)
    assert a.ok and b.ok
    assert not b.cached and a.path != b.path
    assert len(_entries(cache)) == 2


@needs_nvcc
def test_syntax_error_fails_with_the_error_line_in_the_log(tmp_path):
    cache = tmp_path / "cache"
    bad = (TINY % "2.0f").replace("return (int)cudaGetLastError();", "return undeclared_name;")
    line = bad[:bad.index("undeclared_name")].count("\n") + 1
    r = build_fast(_write(tmp_path, "bad.cu", bad), cache, ARCH, 120)
    assert not r.ok and r.path is None and not r.cached
    assert f"bad.cu({line}): error" in r.log and "undeclared_name" in r.log
    assert str(tmp_path) not in r.log.replace(str(cache), "")   # temp dir paths stripped
    assert _entries(cache) == []


@needs_nvcc
def test_timeout_kills_the_build_and_leaves_no_cache_entry(tmp_path):
    cache = tmp_path / "cache"
    r = build_fast(_write(tmp_path, "slow.cu", TINY % "5.0f"), cache, ARCH, 0.05)
    assert not r.ok and "timed out after 0.05s" in r.log
    assert _entries(cache) == []


def test_python_candidate_with_a_latin1_comment_loads(tmp_path):
    # Python accepts the stray byte in a comment; reading the file as UTF-8 text must not crash.
    from evoattn.child.loader import build_candidate
    from evoattn.problems import get_problem
    path = tmp_path / "latin1.py"
    path.write_bytes(b"# caf\xe9\ndef attention(q, k, v, causal=False, scale=None):\n    return q\n")
    loaded = build_candidate(path, get_problem("sdpa"), tmp_path / "cache", 10.0, None)()
    assert loaded.form == "python"


# ---- the shared rules: conditions and companion selection -------------------------

def test_cuda_companions_are_the_cu_files_whose_conditions_hold():
    from evoattn.contract.runtime import cuda_companions, parse_conditions
    comps = [("fast.cu", parse_conditions("when(@target=sm90) when(USE=True)")),
             ("any.cu", ()), ("helper.py", ()),
             ("fast.cuh", parse_conditions("when(@target=sm90)"))]
    assert cuda_companions(comps, {"USE": "True"}, {"target": "sm90"}) == ["fast.cu", "any.cu"]
    assert cuda_companions(comps, {"USE": "True"}, {"target": "sm80"}) == ["any.cu"]
    assert cuda_companions(comps, {"USE": "False"}, {"target": "sm90"}) == ["any.cu"]
    # conditions as a JSON file gives them back (lists), as an exported package reads them
    as_json = [(n, [[list(t) for t in g] for g in w]) for n, w in comps]
    assert cuda_companions(as_json, {"USE": "True"}, {"target": "sm90"}) == ["fast.cu", "any.cu"]
    assert cuda_companions(as_json, {"USE": "True"}, {"target": "sm80"}) == ["any.cu"]


def test_the_target_fact_of_an_arch_drops_the_suffix():
    assert runtime.target_fact("sm_90a") == "sm90" and runtime.target_fact("sm_86") == "sm86"
    assert runtime.target_fact("sm_100a") == "sm100"


@pytest.mark.parametrize("module", ["runtime", "runtime_rules"])
def test_the_runtime_imports_only_the_standard_library_and_its_rules(module: str):
    """An exported package ships these files: they must import where only the package is
    (the runtime's one relative import is its rules, shipped beside it under the same name)."""
    import ast
    import importlib
    import sys
    path = Path(importlib.import_module(f"evoattn.contract.{module}").__file__)
    tree = ast.parse(path.read_text())
    relative = {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.level}
    top = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
           for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
           and not getattr(n, "level", 0)
           for a in (n.names if isinstance(n, ast.Import) else [n])}
    assert top - {"__future__"} <= set(sys.stdlib_module_names), top
    assert relative <= ({"runtime_rules"} if module == "runtime" else set()), relative


# A wgmma whose accumulator the code reads before waiting for it: ptxas injects a wait there and
# says so (C7517, as "info"), in a build that succeeds.
WGMMA_READ_IN_FLIGHT = r"""
#include <cuda_runtime.h>
__global__ void early_read(float* out, unsigned long long da, unsigned long long db, int flag) {
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, %4, %5, 1, 1, 1, 0, 0;\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db));
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  if (flag) d[0] = 5.f;
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  out[threadIdx.x] = d[0] + d[1] + d[2] + d[3];
}
extern "C" int evoattn_sdpa(const void* q, const void* k, const void* v, void* out, int B,
                            int H, int S, int D, int dtype, int causal, float scale,
                            void* stream) {
  early_read<<<1, 128, 0, (cudaStream_t)stream>>>((float*)out, 0, 0, causal);
  return (int)cudaGetLastError();
}
"""


@needs_nvcc
def test_a_build_keeps_ptxas_wgmma_advisories_and_perf_notes_reads_them(tmp_path):
    r = build_fast(_write(tmp_path, "k.cu", WGMMA_READ_IN_FLIGHT), tmp_path / "cache", ARCH, 120)
    assert r.ok, r.log
    notes = runtime.perf_notes(r.log)
    assert notes and all(n.startswith("C75") for n in notes), r.log   # C7517 from nvcc 13.0
    assert any("wait" in n or "serialized" in n for n in notes), notes
    assert all(n.endswith("(1 function)") and "early_read" not in n for n in notes), notes
    clean = build_fast(_write(tmp_path, "tiny.cu", TINY % "2.0f"), tmp_path / "cache", ARCH, 120)
    assert clean.ok and runtime.perf_notes(clean.log) == []
