"""benchmarks.round_order without a GPU: its arguments are checked before anything runs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE = "benchmarks.round_order"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", MODULE, *args], capture_output=True, cwd=ROOT,
                          text=True, timeout=300)


def test_configs_parse_with_their_causal_mark() -> None:
    from benchmarks import round_order as mod
    assert mod.parse_configs("8,32,512,64,nc; 2,32,2048,64,causal;") == [
        (8, 32, 512, 64, False), (2, 32, 2048, 64, True)]
    assert mod.parse_configs("1,8,512,64") == [(1, 8, 512, 64, False), (1, 8, 512, 64, True)]
    assert len(mod.parse_configs(mod.DEFAULT)) == 5


def test_bad_arguments_get_one_line_and_exit_2() -> None:
    bad = _run("--pauses", "none,nap")
    assert bad.returncode == 2 and "no pause named 'nap'" in bad.stderr
    few = _run("--rounds", "3")
    assert few.returncode == 2 and "--rounds: at least 4" in few.stderr
    odd = _run("--configs", "8,32,512")
    assert odd.returncode == 2 and "--configs: config '8,32,512'" in odd.stderr


def test_without_a_gpu_it_says_so() -> None:
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run")
    out = _run("--rounds", "4")
    assert out.returncode == 2 and "no CUDA GPU here" in out.stderr
