"""benchmarks.crosscheck on the CPU: a program is checked before it is timed, timed beside
every baseline in rounds of reversed order, and its speedup is over the fastest baseline."""
from __future__ import annotations

import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE = "benchmarks.crosscheck"

RIGHT = """
    import torch.nn.functional as F

    def attention(q, k, v, causal=False, scale=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
"""
WRONG = """
    import torch

    def attention(q, k, v, causal=False, scale=None):
        return torch.zeros_like(q)
"""


def _module():
    from benchmarks import crosscheck
    return crosscheck


def _program(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return path


def test_a_right_program_is_timed_beside_every_baseline_in_reversed_rounds(
        tmp_path, monkeypatch) -> None:
    """Every round times the program and each baseline once, the order reversed every other
    round; the speedup is the median of the rounds' ratios to the fastest baseline."""
    cc = _module()
    order: list[int] = []
    script = iter([4.0, 2.0, 1.0, 1.0, 8.0, 4.0, 3.0, 1.0, 2.0, 6.0, 9.0, 3.0] * 4)

    def fake_ms(fn):
        order.append(id(fn))
        return next(script)

    monkeypatch.setattr(cc, "timer", lambda on_gpu: fake_ms)
    got = cc.crosscheck(_program(tmp_path, "right", RIGHT), "sdpa", "1,2,64,64,causal",
                        "float32", 4, tmp_path / "cache")
    (row,) = got["configs"]
    assert row["passed"] and row["max_err"] <= row["bound"]
    names = list(row["ms"])
    assert names[0] == "program" and len(names) >= 2           # the program and the baselines
    n = len(names)
    first, second = order[:n], order[n:2 * n]
    assert second == first[::-1]                               # the second round reversed
    assert all(len(v) == 4 for v in row["ms"].values())
    assert row["fastest"] == min(names[1:], key=lambda m: statistics.median(row["ms"][m]))
    ratios = [b / p for b, p in zip(row["ms"][row["fastest"]], row["ms"]["program"])]
    assert row["speedup"] == pytest.approx(statistics.median(ratios))
    assert got["geomean"] == pytest.approx(row["speedup"])


def test_a_wrong_program_fails_its_check_untimed_and_exits_1(tmp_path) -> None:
    wrong = _program(tmp_path, "wrong", WRONG)
    out = subprocess.run([sys.executable, "-m", MODULE, str(wrong), "--configs", "1,2,64,64",
                          "--dtype", "float32", "--rounds", "1"],
                         capture_output=True, cwd=ROOT, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert "1,2,64,64" in out.stdout or "(1,2,64,64)" in out.stdout
    assert "FAIL, max error" in out.stdout and "n/a the fastest baseline" in out.stdout


def test_a_right_program_runs_end_to_end_and_writes_its_json(tmp_path) -> None:
    import json
    right = _program(tmp_path, "right", RIGHT)
    out_json = tmp_path / "cc.json"
    out = subprocess.run([sys.executable, "-m", MODULE, str(right), "--configs", "1,2,64,64,nc",
                          "--dtype", "float32", "--rounds", "2", "--json", str(out_json)],
                         capture_output=True, cwd=ROOT, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out_json.read_text())
    assert got["timer"] == "cpu loop" and got["device"] == "cpu"
    (row,) = got["configs"]
    assert row["passed"] and all(len(v) == 2 for v in row["ms"].values())
    assert "the fastest baseline (cpu loop, geometric mean over 1 configs)" in out.stdout


@pytest.mark.parametrize("args, says", [
    (["--problem", "nosuch"], "--problem: unknown problem 'nosuch'"),
    (["--problem", "mha", "--dtype", "float16"], "--dtype: problem mha takes float32"),
    (["--configs", "1,2,x"], "--configs: config '1,2,x'"),
    (["--rounds", "0"], "--rounds must be at least 1"),
])
def test_a_bad_argument_gets_one_line_naming_it_and_exit_2(args, says) -> None:
    out = subprocess.run([sys.executable, "-m", MODULE, str(ROOT / "seeds/sdpa/naive_torch.py"),
                          *args], capture_output=True, cwd=ROOT, text=True, timeout=300)
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
