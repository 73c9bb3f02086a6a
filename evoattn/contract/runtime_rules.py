"""The rules a program's CUDA build follows, in the standard library only: the `when(...)`
grammar that gates knobs and companion files, the nvcc target of a GPU and its flags, the
toolchain's identity and the cache key, which of a program's files a GPU builds, and ptxas's
advisories. runtime.py builds and loads by them; an exported package ships both files
unchanged (this one under its own name, beside `_runtime.py`).
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterable, Mapping

HEADER_SUFFIXES = (".cuh", ".h", ".hpp", ".inc")


# ---- when(...) conditions ------------------------------------------------------
#     when(PATH=a, PATH=b)              one group: any of its terms holds
#     when(@target=sm90) when(X!=1)     several groups: all must hold
# Terms are NAME=VALUE or NAME!=VALUE. A NAME starting with @ is a fact about the run that the
# caller passes in (`@target`: "cpu", or "smXY" for the GPU's compute capability); any other
# NAME is a knob of the program. A fact that was not given, or a knob the program does not
# have, counts as holding: an unknown term never rules anything out.

Term = tuple[str, str, str]            # (name, "=" or "!=", value)
Group = tuple[Term, ...]               # alternatives
Conditions = tuple[Group, ...]         # all must hold

_WHEN = re.compile(r"\bwhen\((?P<conds>[^)]*)\)")
_TERM = re.compile(r"^\s*(?P<name>@?\w+)\s*(?P<op>!=|=)\s*(?P<value>\S+?)\s*$")


def parse_conditions(text: str) -> Conditions:
    """Returns the when(...) groups found in text (malformed terms are ignored)."""
    groups = []
    for m in _WHEN.finditer(text):
        terms = [t for t in (_TERM.match(c) for c in m.group("conds").split(",")) if t]
        if terms:
            groups.append(tuple((t["name"], t["op"], t["value"]) for t in terms))
    return tuple(groups)


def holds(conditions: Iterable[Iterable[Iterable[str]]], values: Mapping[str, str],
          facts: Mapping[str, str] | None = None) -> bool:
    """Returns whether every group has a term that holds for these knob values and facts
    (terms as (name, op, value) tuples, or the lists a JSON file gives back)."""
    facts = facts or {}

    def term(name: str, op: str, value: str) -> bool:
        have = facts.get(name[1:]) if name.startswith("@") else values.get(name)
        if have is None:
            return True
        return (have == value) == (op == "=")

    return all(any(term(*t) for t in group) for group in conditions)


# ---- target and toolchain ------------------------------------------------------

def detect_arch() -> str:
    """Returns the nvcc target of the current GPU, e.g. "sm_90a" on an H100."""
    import torch
    return arch_for(*torch.cuda.get_device_capability())


def arch_for(major: int, minor: int) -> str:
    """Returns the nvcc target of a compute capability, e.g. "sm_90a" for 9.0."""
    if (major, minor) == (9, 0):
        return "sm_90a"                 # wgmma / TMA need the arch-specific target
    if (major, minor) == (10, 0):
        return "sm_100a"
    return f"sm_{major}{minor}"


def target_fact(arch: str) -> str:
    """Returns the `@target` fact of an nvcc target: "sm_90a" -> "sm90"."""
    return "sm" + "".join(c for c in arch.removeprefix("sm_") if c.isdigit())


def gencode_flags(arch: str) -> list[str]:
    """Returns explicit -gencode flags for an "sm_XY[a]" target (no implicit extra passes)."""
    m = re.fullmatch(r"sm_(\d+)([a-z]?)", arch)
    if m is None:
        raise ValueError(f"unknown CUDA arch {arch!r}: expected e.g. 'sm_90a' or 'sm_86'")
    num, suffix = m.groups()
    return [f"-gencode=arch=compute_{num}{suffix},code=sm_{num}{suffix}"]


def torch_arch_list(arch: str) -> str:
    """Returns the TORCH_CUDA_ARCH_LIST entry for a target: "sm_90a" -> "9.0a"."""
    m = re.fullmatch(r"sm_(\d+)(\d)([a-z]?)", arch)
    if m is None:
        raise ValueError(f"unknown CUDA arch {arch!r}")
    return f"{m.group(1)}.{m.group(2)}{m.group(3)}"


@functools.lru_cache(maxsize=None)
def toolchain_id(nvcc: str = "nvcc", with_torch: bool = False) -> str:
    """Returns a short hash of `nvcc --version` (and torch's version for the extension form)."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = "nvcc-unavailable"
    if with_torch:
        import torch
        out += f"\ntorch {torch.__version__} cuda {torch.version.cuda}"
    return hashlib.sha256(out.encode()).hexdigest()[:12]


def cache_key(source: bytes, kind: str, arch: str, flags: list[str], toolchain: str) -> str:
    """Returns the cache entry name for one build."""
    h = hashlib.sha256(source)
    for part in (kind, arch, " ".join(flags), toolchain):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:24]


# ---- a program's CUDA files ------------------------------------------------------

def cuda_form(source: str) -> str:
    """Returns 'cuda-ext' for a PyTorch-extension source, else 'cuda-fast'."""
    if re.search(r"#\s*include\s*[<\"](torch/extension\.h|torch/torch\.h|ATen/)", source) or \
            re.search(r"torch::Tensor\s+attention\s*\(", source):
        return "cuda-ext"
    return "cuda-fast"


def cuda_companions(companions: Iterable[tuple[str, Any]], values: Mapping[str, str],
                    facts: Mapping[str, str]) -> list[str]:
    """Returns the `.cu` companions (name, conditions) to build for these knob values and facts:
    those whose conditions hold."""
    return [name for name, when in companions
            if Path(name).suffix == ".cu" and holds(when, values, facts)]


def header_files(directory: str | os.PathLike[str], names: Iterable[str]) -> dict[str, bytes]:
    """Returns the header files among names (by name), read from directory where present:
    they are written beside every `.cu` build and are part of its cache key."""
    d = Path(directory)
    return {n: (d / n).read_bytes() for n in names
            if Path(n).suffix in HEADER_SUFFIXES and (d / n).is_file()}


def find_nvcc() -> str:
    """Returns the nvcc to run: on PATH, else under $CUDA_HOME (or /usr/local/cuda), else
    "nvcc" (a build then reports that it is missing)."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.is_file() else "nvcc"


# ptxas's advisories on wgmma (C75xx), printed as "info" (no -v needed) by a build that
# succeeds: "(C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized
# due to ... in the function '...'" (every wgmma of that kernel serialised), "(C7517)
# warpgroup.wait is injected in around line N by compiler to allow use of registers defined by
# GMMA in function '...'" (a wait the code did not ask for).
_PERF_NOTE = re.compile(r"\((C75\d\d)\)\s*(?:Potential Performance Loss:\s*)?(.+?)"
                        r"(?: in (?:the )?function '[^']*')?\s*$")


def perf_notes(log: str) -> list[str]:
    """Returns ptxas's performance advisories in a build log, one line per distinct one, with
    the number of functions it names: "C7515: wgmma.mma_async instructions are serialized due
    to ... (4 functions)"."""
    counts: dict[tuple[str, str], int] = {}
    for line in log.splitlines():
        if (m := _PERF_NOTE.search(line)):
            key = (m.group(1), m.group(2).strip())
            counts[key] = counts.get(key, 0) + 1
    return [f"{code}: {text} ({n} function{'s' if n > 1 else ''})"
            for (code, text), n in counts.items()]
