"""Builds the kernel's CUDA files on first use into a per-user cache, or takes a prebuilt one.

A fast-form `.cu` (an `extern "C"` entry) is compiled by nvcc into a shared library with the
flags the evaluator used; a PyTorch-extension `.cu` is built by torch.utils.cpp_extension.
The cache entry is keyed by the kernel files, the target and the toolchain, and is written
into a temporary directory renamed into place, so an interrupted build leaves nothing half
done. A library shipped as kernel/prebuilt/<stem>.<arch>.so is used as it is.
Cache: $EVOATTN_KERNEL_CACHE, else $XDG_CACHE_HOME/evoattn-kernels, else ~/.cache/evoattn-kernels.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

BUILD_TIMEOUT_S = 900
_LIB = "lib.so"


class KernelBuildError(RuntimeError):
    """A CUDA file of the kernel could not be built (the message ends with the log's tail)."""


def cache_root() -> Path:
    """Returns the directory holding built kernels."""
    if os.environ.get("EVOATTN_KERNEL_CACHE"):
        return Path(os.environ["EVOATTN_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "evoattn-kernels"


def arch_of(capability: tuple[int, int]) -> str:
    """Returns the nvcc target of a compute capability: Hopper and Blackwell get the 'a' one."""
    major, minor = capability
    suffix = "a" if (major, minor) in ((9, 0), (10, 0)) else ""   # wgmma, TMA, setmaxnreg
    return f"sm_{major}{minor}{suffix}"


def nvcc() -> str:
    """Returns the nvcc to use: on PATH, else under $CUDA_HOME (KernelBuildError if neither)."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    if candidate.is_file():
        return str(candidate)
    raise KernelBuildError("nvcc not found on PATH or in $CUDA_HOME/bin: it is needed once to "
                           "build the kernel's CUDA code (or ship kernel/prebuilt/*.so)")


def _flags(arch: str) -> list[str]:
    num = arch[3:]
    return ["-O3", "-lineinfo", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
            f"-gencode=arch=compute_{num},code=sm_{num}"]


def _key(kernel_dir: Path, kind: str, arch: str, flags: list[str], tool: str) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in kernel_dir.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    try:
        version = subprocess.run([tool, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = "unknown"
    for part in (kind, arch, " ".join(flags), version):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:24]


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def build_fast(source: Path, arch: str) -> str:
    """Returns the path of the shared library built from a fast-form .cu (built once)."""
    prebuilt = source.parent / "prebuilt" / f"{source.stem}.{arch}.so"
    if prebuilt.is_file():
        return str(prebuilt)
    tool = nvcc()
    flags = _flags(arch)
    final = cache_root() / _key(source.parent, f"fast:{source.name}", arch, flags, tool)
    if (final / _LIB).is_file():
        return str(final / _LIB)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        proc = subprocess.run([tool, *flags, "-o", str(tmp / _LIB), source.name],
                              cwd=source.parent, capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0 or not (tmp / _LIB).is_file():
            raise KernelBuildError(f"nvcc failed on {source.name} for {arch}:\n"
                                   + _tail(proc.stdout + proc.stderr))
        _install(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final / _LIB)


_WRAPPER = """\
#include <torch/extension.h>
#include "{source}"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{
  m.def("attention", &attention, "evolved attention");
}}
"""


def build_extension(source: Path, arch: str) -> object:
    """Returns the imported PyTorch extension built from a .cu defining attention()."""
    from torch.utils import cpp_extension
    flags = [f"-gencode=arch=compute_{arch[3:]},code=sm_{arch[3:]}", "-O3", "-lineinfo"]
    import torch          # an extension is built against this torch's ABI: part of its key
    key = _key(source.parent, f"ext:{source.name}:torch {torch.__version__}", arch, flags, nvcc())
    build_dir = cache_root() / f"ext-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    wrapper = build_dir / "wrapper.cu"
    wrapper.write_text(_WRAPPER.format(source=source.resolve()))
    digits = arch[3:].rstrip("a")
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    # cpp_extension reads its target from the environment: set it for this build only.
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{digits[:-1]}.{digits[-1]}{arch[3 + len(digits):]}"
    try:
        return cpp_extension.load(name=f"evoattn_ext_{key}", sources=[str(wrapper)],
                                  build_directory=str(build_dir), extra_cuda_cflags=flags,
                                  verbose=False)
    except Exception as e:  # noqa: BLE001 - cpp_extension raises RuntimeError or subprocess errors
        raise KernelBuildError(f"cannot build the extension {source.name}: {e}") from None
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


def _install(tmp: Path, final: Path) -> None:
    """Moves a finished build into place; a concurrent build that won the race is kept."""
    staged = Path(tempfile.mkdtemp(prefix=".stage-", dir=final.parent))
    os.replace(tmp / _LIB, staged / _LIB)
    try:
        os.replace(staged, final)
    except OSError:
        shutil.rmtree(staged, ignore_errors=True)
        if not (final / _LIB).is_file():
            raise
