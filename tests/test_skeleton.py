"""`evoattn new-kernel`: skeletons that evaluate (.py, on the CPU) and build (.cu, with nvcc)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evoattn.contract import runtime
from evoattn.contract.knobs import find_knobs
from evoattn.skeleton import skeleton_text

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--device", "cpu", "--configs", "1,2,64,64;1,2,64,64,causal", "--trials", "1",
        "--reps", "2"]


def _evoattn(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoattn.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def _one_line(p: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def test_the_python_skeleton_evaluates_correct_on_the_cpu(tmp_path: Path) -> None:
    made = _evoattn("new-kernel", str(tmp_path / "mine.py"))
    assert made.returncode == 0, made.stdout + made.stderr
    assert f"evoattn eval {tmp_path / 'mine.py'}" in made.stdout
    p = _evoattn("eval", str(tmp_path / "mine.py"), *FAST)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Correctness: PASS" in p.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_the_cuda_skeleton_builds_and_exports_the_sdpa_entry(tmp_path: Path) -> None:
    made = _evoattn("new-kernel", str(tmp_path / "mine"), "--form", "cu")
    assert made.returncode == 0, made.stdout + made.stderr
    src = tmp_path / "mine.cu"
    built = runtime.build_fast(src, tmp_path / "cache", "sm_90a", 300)
    assert built.ok, built.log
    fn = runtime.load_fast(built.path, "evoattn_sdpa")
    assert len(fn.argtypes) == 12 and fn.argtypes[10] is ctypes.c_float


def test_skeletons_quote_the_problems_contract_and_mark_the_body() -> None:
    from evoattn.problems import get_problem
    first = get_problem("sdpa").contract.split(" (B,")[0]          # "Compute out = softmax(..."
    for suffix in (".py", ".cu"):
        text = skeleton_text("sdpa", suffix, f"k{suffix}")
        assert first in text and text.count("---- ") == 2, suffix
    assert [k.name for k in find_knobs(skeleton_text("sdpa", ".cu", "k.cu"))] == ["THREADS"]


def test_new_kernel_never_overwrites_a_file(tmp_path: Path) -> None:
    mine = tmp_path / "kernel.cu"
    mine.write_text("// my work\n")
    p = _evoattn("new-kernel", str(mine))
    assert p.returncode == 4 and "already exists" in _one_line(p)
    assert mine.read_text() == "// my work\n"


@pytest.mark.parametrize("args, needle", [
    (["k.py", "--form", "cu"], "a .py file cannot hold the cu form"),
    (["k"], "name a .cu or .py file, or give --form cu|py"),
    (["k.py", "--problem", "gqa"], "no .py skeleton for it"),
    (["k.py", "--problem", "nope"], "unknown problem 'nope'"),
])
def test_new_kernel_bad_input_is_one_line_and_exit_4(tmp_path: Path, args: list[str],
                                                     needle: str) -> None:
    p = _evoattn("new-kernel", str(tmp_path / args[0]), *args[1:])
    assert p.returncode == 4 and needle in _one_line(p)
    assert not list(tmp_path.iterdir())                          # nothing written
