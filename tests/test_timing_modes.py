"""Timing modes and baselines through the real CLI on the CPU: what `evoattn eval --json`
reports per config (every mode, every baseline), the kernel-mode fitness rule, FlexAttention
baselines for the masked, sparse and biased problems, and call-mode hidden work."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ADV = ROOT / "tests" / "adversarial"


def _eval(tmp: Path, path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp / f"r{len(list(tmp.glob('r*.json')))}.json"
    p = subprocess.run([sys.executable, "-m", "evoattn.cli", "eval", str(path), "--device", "cpu",
                        "--json", str(out), *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=900, env=dict(os.environ))
    return p, (json.loads(out.read_text()) if out.is_file() else {})


def test_eval_reports_every_mode_and_baseline_per_config(tmp_path: Path) -> None:
    p, r = _eval(tmp_path, ROOT / "seeds/sdpa/flash_triton.py")
    assert p.returncode == 0, p.stdout + p.stderr
    assert r["timing"] == "call" and r["baseline"] == "best"
    assert "call time" in p.stdout                     # the table and headline name the mode
    for c in r["configs"]:
        for key in ("kernel_ms", "call_ms", "host_us"):
            assert isinstance(c[key], float) and c[key] > 0, (key, c[key])
        assert c["graph_ms"] is None and "GPU" in c["graph_error"]
        assert set(c["baselines"]) == {"sdpa"} and c["baseline_name"] == "sdpa"
        assert c["ms"] == c["call_ms"] and c["baseline_ms"] == c["baselines"]["sdpa"]
        # The median of the rounds' ratios: near the ratio of the medians on a steady host.
        assert c["speedup"] == pytest.approx(c["baseline_ms"] / c["ms"], rel=0.2)
        assert c["speedup_ci"][0] <= c["speedup"] <= c["speedup_ci"][1]
        assert c["baseline_times"]["sdpa"]["kernel_ms"] > 0
        # call mode's issue time, taken in its rounds: on the CPU, where a call is done when
        # it returns, about their time per call (a median over 4 rounds beside the mean of
        # their two pairs: a busy CI host moves them apart by 10% and more; a time per batch
        # instead of per call, or in ms, would be 8-1000x off)
        for t in (c["times"], c["baseline_times"]["sdpa"]):
            assert 0.5 < t["issue_us"] / (t["call_ms"] * 1e3) < 1.5


def test_kernel_timing_reproduces_the_kernel_time_fitness(tmp_path: Path) -> None:
    p, r = _eval(tmp_path, ROOT / "seeds/sdpa/naive_torch.py", "--timing", "kernel")
    assert p.returncode == 0, p.stdout + p.stderr
    assert r["timing"] == "kernel" and "kernel time" in p.stdout
    speedups = []
    for c in r["configs"]:
        assert c["ms"] == c["kernel_ms"]
        assert c["speedup"] == pytest.approx(
            c["baseline_times"]["sdpa"]["kernel_ms"] / c["kernel_ms"], rel=0.2)
        speedups.append(c["speedup"])
    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    assert r["fitness"] == pytest.approx(geo)


def test_graph_timing_on_the_cpu_is_a_usage_error(tmp_path: Path) -> None:
    p, _ = _eval(tmp_path, ROOT / "seeds/sdpa/naive_torch.py", "--timing", "graph")
    assert p.returncode == 4 and "CUDA graphs need a GPU" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_a_named_baseline_must_be_one_of_the_problems(tmp_path: Path) -> None:
    p, _ = _eval(tmp_path, ROOT / "seeds/sdpa/naive_torch.py", "--baseline", "flex")
    assert p.returncode == 4 and "has the baselines sdpa" in p.stderr


@pytest.mark.parametrize("seed, problem, names", [
    ("seeds/sliding_window/window_triton.py", "sliding_window", {"sdpa_mask", "flex"}),
    ("seeds/strided/strided_triton.py", "strided", {"sdpa_mask", "flex", "gather_sdpa"}),
    ("seeds/masked/masked_triton.py", "masked", {"sdpa_mask", "flex"}),
    ("seeds/alibi/alibi_triton.py", "examples/alibi/problem.py", {"baseline", "flex"}),
    ("examples/softcap/seed.py", "examples/softcap/problem.py", {"baseline", "flex"}),
])
def test_masked_and_biased_problems_time_flexattention_too(tmp_path: Path, seed: str,
                                                            problem: str, names: set) -> None:
    p, r = _eval(tmp_path, ROOT / seed, "--problem",
                 str(ROOT / problem) if problem.endswith(".py") else problem)
    assert p.returncode == 0, p.stdout + p.stderr
    for c in r["configs"]:
        assert set(c["baselines"]) == names, c["baselines"]
        assert all(v > 0 for v in c["baselines"].values())
        fastest = min(c["baselines"], key=c["baselines"].get)     # baseline: best
        assert c["baseline_name"] == fastest
        assert c["baseline_ms"] == c["baselines"][fastest]


def test_gqa_times_its_repeat_baseline(tmp_path: Path) -> None:
    p, r = _eval(tmp_path, ROOT / "seeds/gqa/gqa_triton.py", "--problem", "gqa")
    assert p.returncode == 0, p.stdout + p.stderr
    assert all(set(c["baselines"]) == {"sdpa_gqa", "repeat_sdpa"} for c in r["configs"])


def test_work_deferred_into_the_next_call_does_not_gain_in_call_mode(tmp_path: Path) -> None:
    p, r = _eval(tmp_path, ADV / "defer_next_call.py")
    assert p.returncode == 1, p.stdout + p.stderr
    assert r["verdict"] == "hidden_work" and r["fitness"] == 0
    assert "back to back" in r["reason"] and "deferred past the timer" in r["reason"]
