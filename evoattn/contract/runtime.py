"""How a program's CUDA files are built, cached and loaded: standard library only.

The evaluator's child process and an exported package both run this file (the package ships it
unchanged as `_runtime.py`, with runtime_rules.py beside it under its own name), so a kernel is
built with the same flags, cache key and companion rules wherever it runs. The rules (the
`when(...)` grammar, the nvcc target and flags, the cache key, which companions a GPU builds)
live in runtime_rules.py and are named through this module too. This one holds:
  builds      fast form (a plain .cu with an `extern "C"` entry, built by nvcc into `lib.so`,
              called through ctypes) and extension form (a .cu defining
              `torch::Tensor attention(...)`, built by torch.utils.cpp_extension), both in a
              child process, so no build changes this process's environment; and a
              host module (a C++ Python module using torch's headers, no CUDA), the same way;
  loading     a built library, a built extension, a Python main file with its libraries.
Builds happen in a temporary directory inside the cache and are moved into `cache_dir/<key>/`
with one `os.replace`, so a killed build never leaves a half-written entry. A candidate's bad
source is a `BuildResult(ok=False)`, never an exception. torch is imported lazily (only to load
an extension or to name its version), so this module imports without CUDA or torch.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from .runtime_rules import (HEADER_SUFFIXES, Conditions, arch_for, cache_key,  # noqa: F401
                            cuda_companions, cuda_form, detect_arch, find_nvcc, gencode_flags,
                            header_files, holds, parse_conditions, perf_notes, target_fact,
                            toolchain_id, torch_arch_list)

DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2}   # a dtype's int in CUDA entry calls
LOG_LIMIT_CHARS = 4096
_FAST_LIB = "lib.so"
_EXT_PREFIX = "evoattn_ext_"
LIBRARIES_GLOBAL = "EVOATTN_LIBRARIES"     # a Python main file's built companions, by name

# argtypes of each fast-form entry point, keyed by symbol (see the problem's `cuda_signature`).
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
FAST_SIGNATURES: dict[str, tuple[Any, ...]] = {
    # q, k, v, out, B, H, S, D, dtype, causal, scale, stream
    "evoattn_sdpa": (_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P),
}
# The dtype argument of a fast-form entry, by torch dtype name (the CUDA side's switch).
DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2}


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """Outcome of one build: the library's path when ok, the (trimmed) compiler log either way."""

    ok: bool
    path: str | None
    log: str
    cached: bool
    seconds: float


class LoadError(Exception):
    """A built library cannot be loaded or lacks its entry point (the worker's LOAD_ERROR)."""


# ---- fast form -----------------------------------------------------------------

def fast_flags(arch: str) -> list[str]:
    """Returns the nvcc flags of the fast form (no --use_fast_math: it costs precision)."""
    return ["-O3", "-lineinfo", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
            *gencode_flags(arch)]


def build_fast(source_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str],
               arch: str, timeout_s: float, nvcc: str = "nvcc",
               extra_files: dict[str, bytes] | None = None,
               env: dict[str, str] | None = None) -> BuildResult:
    """Compiles a fast-form .cu into `cache_dir/<key>/lib.so`, or returns the cached one.

    `extra_files` (a program's headers, by file name) are written beside the source and are
    part of the cache key; nvcc runs in `env` (default: this process's environment).
    """
    t0 = time.monotonic()
    flags = fast_flags(arch)
    source, err = _read(source_path)
    if source is None:
        return BuildResult(False, None, err, False, 0.0)
    extra = dict(sorted((extra_files or {}).items()))
    keyed = source + b"".join(b"\0" + n.encode() + b"\0" + t for n, t in extra.items())
    key = cache_key(keyed, "fast", arch, flags, toolchain_id(nvcc))
    final = Path(cache_dir) / key
    if (hit := _cached(final, _FAST_LIB, t0)) is not None:
        return hit
    if shutil.which(nvcc) is None:
        return BuildResult(False, None, f"nvcc not found ({nvcc!r})", False, 0.0)

    tmp = _make_tmp(cache_dir)
    name = _safe_name(Path(source_path).name)
    for extra_name, text in extra.items():
        (tmp / Path(extra_name).name).write_bytes(text)
    (tmp / name).write_bytes(source)
    ok, log = _run_group([nvcc, *flags, "-o", _FAST_LIB, name], tmp, timeout_s,
                         os.environ if env is None else env)
    return _finish(ok, tmp, final, _FAST_LIB, log, t0)


def load_fast(path: str, symbol: str) -> Callable[..., int]:
    """Returns the ctypes function `symbol` of a built library, typed from FAST_SIGNATURES."""
    if symbol not in FAST_SIGNATURES:
        raise KeyError(f"no argtypes known for symbol {symbol!r}; add it to FAST_SIGNATURES")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise LoadError(f"cannot load {path}: {e}") from None
    try:
        fn = getattr(lib, symbol)
    except AttributeError:
        raise LoadError(f'{path} does not export extern "C" {symbol}') from None
    fn.restype = ctypes.c_int
    fn.argtypes = list(FAST_SIGNATURES[symbol])
    return fn


# ---- PyTorch-extension form ----------------------------------------------------

_WRAPPER = """\
// Generated by evoattn: binds the candidate's attention() into a Python module.
#include <torch/extension.h>
#include "src/{name}"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{
  m.def("attention", &attention, "evoattn candidate attention");
}}
"""

_EXT_DRIVER = """\
import sys
from torch.utils.cpp_extension import load
name, wrapper, build_dir = sys.argv[1:4]
load(name=name, sources=[wrapper], build_directory=build_dir,
     extra_cuda_cflags=sys.argv[4:], verbose=False)
"""


def build_extension(source_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str],
                    arch: str, timeout_s: float, nvcc: str = "nvcc") -> BuildResult:
    """Builds a PyTorch-extension .cu with cpp_extension in a child process; returns the .so."""
    t0 = time.monotonic()
    flags = [*gencode_flags(arch), "-O3", "-lineinfo"]
    source, err = _read(source_path)
    if source is None:
        return BuildResult(False, None, err, False, 0.0)
    key = cache_key(source, "extension", arch, flags, toolchain_id(nvcc, with_torch=True))
    final = Path(cache_dir) / key
    mod_name = _EXT_PREFIX + key
    rel_so = f"build/{mod_name}.so"
    if (hit := _cached(final, rel_so, t0)) is not None:
        return hit

    tmp = _make_tmp(cache_dir)
    name = _safe_name(Path(source_path).name)
    (tmp / "src").mkdir()
    (tmp / "src" / name).write_bytes(source)
    (tmp / "wrapper.cu").write_text(_WRAPPER.format(name=name))
    (tmp / "build").mkdir()
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=torch_arch_list(arch),
               TORCH_EXTENSIONS_DIR=str(tmp / "build"))
    nvcc_dir = os.path.dirname(shutil.which(nvcc) or "")
    if nvcc_dir:                        # cpp_extension finds nvcc through CUDA_HOME
        env.setdefault("CUDA_HOME", os.path.dirname(nvcc_dir))
    cmd = [sys.executable, "-c", _EXT_DRIVER, mod_name, str(tmp / "wrapper.cu"),
           str(tmp / "build"), *flags]
    ok, log = _run_group(cmd, tmp, timeout_s, env)
    return _finish(ok, tmp, final, rel_so, log, t0)


_HOST_PREFIX = "evoattn_host_"
_HOST_FLAGS = ["-O3"]                     # cpp_extension.load passes no optimisation level
_HOST_DRIVER = """\
import sys
from torch.utils.cpp_extension import load
name, source, build_dir = sys.argv[1:4]
load(name=name, sources=[source], build_directory=build_dir, extra_cflags=sys.argv[4:],
     verbose=False)
"""


def build_host_module(source_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str],
                      timeout_s: float,
                      started: Callable[[subprocess.Popen, Path], None] | None = None
                      ) -> BuildResult:
    """Builds a C++ Python module (its init function named after TORCH_EXTENSION_NAME) with
    cpp_extension in a child process; returns the .so, cached per source, Python, torch and
    compiler. `started` is given the build's process and its temporary directory as it starts
    (to stop it early and remove what it wrote)."""
    import torch
    t0 = time.monotonic()
    source, err = _read(source_path)
    if source is None:
        return BuildResult(False, None, err, False, 0.0)
    toolchain = hashlib.sha256(f"{sys.version}\ntorch {torch.__version__}\n"
                               f"{os.environ.get('CXX', 'c++')}".encode()).hexdigest()[:12]
    key = cache_key(source, "host", "", _HOST_FLAGS, toolchain)
    final = Path(cache_dir) / key
    mod_name = _HOST_PREFIX + key
    rel_so = f"build/{mod_name}.so"
    if (hit := _cached(final, rel_so, t0)) is not None:
        return hit
    tmp = _make_tmp(cache_dir)
    name = "module.cpp"                  # C++, not CUDA: cpp_extension goes by the suffix
    (tmp / name).write_bytes(source)
    (tmp / "build").mkdir()
    cmd = [sys.executable, "-c", _HOST_DRIVER, mod_name, str(tmp / name), str(tmp / "build"),
           *_HOST_FLAGS]
    ok, log = _run_group(cmd, tmp, timeout_s, dict(os.environ), started)
    return _finish(ok, tmp, final, rel_so, log, t0)


def load_module(path: str) -> Any:
    """Imports a built module (an extension or a host module) from its .so path."""
    import importlib.machinery
    import importlib.util

    import torch  # noqa: F401  (the extension links against libtorch; load it first)
    name = Path(path).name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise LoadError(f"cannot make an import spec for {path}")
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as e:
        raise LoadError(f"cannot import {path}: {e}") from None
    return module


def load_extension(path: str) -> Any:
    """Imports a built extension module from its .so path."""
    module = load_module(path)
    if not hasattr(module, "attention"):
        raise LoadError(f"{path} defines no attention()")
    return module


def import_main(path: str | os.PathLike[str], name: str,
                libraries: Mapping[str, str] | None = None) -> Any:
    """Imports a Python main file by path as module `name` (registered in sys.modules, as
    Triton and dataclasses look modules up by name), its built companions handed over first
    as the module global EVOATTN_LIBRARIES; whatever the file raises propagates."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LoadError(f"{Path(path).name}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    setattr(module, LIBRARIES_GLOBAL, dict(libraries or {}))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


# ---- helpers -------------------------------------------------------------------

def _read(source_path: str | os.PathLike[str]) -> tuple[bytes | None, str]:
    try:
        return Path(source_path).read_bytes(), ""
    except OSError as e:
        return None, f"cannot read source: {e}"


def _safe_name(name: str) -> str:
    """Returns a file name safe to pass to nvcc (keeps .cu so nvcc treats it as CUDA)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(name).stem) or "candidate"
    return stem + ".cu"


def _make_tmp(cache_dir: str | os.PathLike[str]) -> Path:
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir))


def _run_group(cmd: list[str], cwd: Path, timeout_s: float, env: Any,
               started: Callable[[subprocess.Popen, Path], None] | None = None
               ) -> tuple[bool, str]:
    """Runs cmd in its own process group; kills the whole group on timeout."""
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        return False, f"cannot start {cmd[0]}: {e}"
    if started is not None:
        started(proc, cwd)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        return False, f"build timed out after {timeout_s:g}s"
    text = out.decode("utf-8", errors="replace")
    if proc.returncode != 0:
        return False, trim_log(text) or f"{cmd[0]} exited with status {proc.returncode}"
    return True, trim_log(text)


def _cached(final: Path, artifact: str, t0: float) -> BuildResult | None:
    """The cache entry `final`'s result where it holds `artifact`, else None."""
    if (final / artifact).is_file():
        return BuildResult(True, str(final / artifact), _read_log(final), True,
                           time.monotonic() - t0)
    return None


def _finish(ok: bool, tmp: Path, final: Path, artifact: str, log: str,
            t0: float) -> BuildResult:
    """Moves a finished build into the cache atomically, or discards a failed one (a build
    that exited 0 without writing `artifact` failed); the log names files relative to it."""
    log = log.replace(str(tmp) + os.sep, "")
    if ok and not (tmp / artifact).is_file():
        ok, log = False, log + f"\nthe build exited 0 but wrote no {artifact}"
    seconds = time.monotonic() - t0
    if not ok:
        shutil.rmtree(tmp, ignore_errors=True)
        return BuildResult(False, None, log, False, seconds)
    (tmp / "build.log").write_text(log)
    if final.is_dir() and not (final / artifact).is_file():
        shutil.rmtree(final, ignore_errors=True)   # an entry cleaned half-way: never in use
    try:
        os.replace(tmp, final)
    except OSError:
        # A concurrent build of the same source won the race; keep its entry.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / artifact).is_file():
            return BuildResult(False, None, log + f"\ncannot move build into {final}",
                               False, seconds)
    return BuildResult(True, str(final / artifact), log, False, seconds)


def _read_log(entry: Path) -> str:
    try:
        return (entry / "build.log").read_text()
    except OSError:
        return ""


_DIAG = re.compile(r"(\berror\b|\bfatal\b|undefined reference|Error building)", re.I)


def trim_log(text: str, limit: int = LOG_LIMIT_CHARS) -> str:
    """Returns the log cut to `limit` chars: error lines (with 3 lines of context) first."""
    lines = text.rstrip().splitlines()
    if len(text) <= limit:
        return "\n".join(lines)
    picked: list[int] = []
    seen: set[int] = set()
    for i, line in enumerate(lines):
        if _DIAG.search(line):
            for j in range(i, min(i + 4, len(lines))):
                if j not in seen:
                    seen.add(j)
                    picked.append(j)
    order = picked + [i for i in range(len(lines)) if i not in seen]
    out: list[str] = []
    size = 0
    for i in order:
        if size + len(lines[i]) + 1 > limit - 60:
            break
        out.append(lines[i])
        size += len(lines[i]) + 1
    dropped = len(lines) - len(out)
    if dropped:
        out.append(f"... [{dropped} more lines trimmed]")
    return "\n".join(out)
