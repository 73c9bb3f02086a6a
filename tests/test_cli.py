"""`evoattn` end to end on the CPU: verdicts, exit codes, JSON, and one-line errors."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CANDS = ROOT / "tests" / "candidates"
FAST = ["--device", "cpu", "--configs", "1,2,64,64", "--trials", "2", "--reps", "2"]


def evoattn(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoattn.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600, env=env)


def test_honest_kernel_passes_with_json_and_exit_0(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    p = evoattn("eval", str(ROOT / "seeds/sdpa/naive_torch.py"), *FAST, "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Correctness: PASS" in p.stdout and "Score:" in p.stdout and "CPU" in p.stdout
    data = json.loads(out.read_text())
    assert data["correct"] is True and data["verdict"] == "pass" and data["fitness"] > 0
    assert len(data["configs"]) == 2
    for c in data["configs"]:
        for key in ("B", "H", "S", "D", "causal", "dtype", "verdict", "max_abs_err", "tolerance",
                    "ms", "tflops", "speedup", "peak_mem_bytes"):
            assert key in c
        assert c["max_abs_err"] <= c["tolerance"]
    # where the timing stage went, config by config (the rest: the GPU turn, the CPU pick)
    per_config = [c["timing_s"] for c in data["configs"]]
    assert all(s > 0 for s in per_config) and sum(per_config) <= data["stage_s"]["time"]


def test_incorrect_kernel_fails_with_exit_1_and_the_error(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    p = evoattn("eval", str(CANDS / "wrong_scale.py"), *FAST, "--json", str(out))
    assert p.returncode == 1
    assert "Correctness: FAIL" in p.stdout and "max abs error" in p.stdout
    data = json.loads(out.read_text())
    assert data["verdict"] == "incorrect" and data["fitness"] == 0.0


KNOBBED = '''"""A kernel with one knob: SCALE_FIX = 1.0 is right, 2.0 wrong."""
import torch
SCALE_FIX = 1.0  # evoattn: choice(1.0, 2.0)


def attention(q, k, v, causal=False, scale=None):
    scale = (q.shape[-1] ** -0.5 if scale is None else scale) * SCALE_FIX
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype)
'''


def test_eval_set_changes_the_knob_and_rejects_unknown_ones(tmp_path: Path) -> None:
    f = tmp_path / "knobbed.py"
    f.write_text(KNOBBED)
    assert evoattn("eval", str(f), *FAST).returncode == 0
    wrong = evoattn("eval", str(f), *FAST, "--set", "SCALE_FIX=2.0")
    assert wrong.returncode == 1 and "Correctness: FAIL" in wrong.stdout
    assert f.read_text() == KNOBBED                          # the file itself is untouched
    assert "knobbed.py [SCALE_FIX=2.0]" in wrong.stdout      # the report names the setting
    twice = evoattn("eval", str(f), *FAST, "--set", "SCALE_FIX=1.0", "--set", "SCALE_FIX=2.0")
    assert twice.returncode == 4 and "given twice" in twice.stderr
    for bad, needle in (("SCALE_FIX=3.0", "not among its choices (1.0, 2.0)"),
                        ("NOPE=1", "no such knob (knobs: SCALE_FIX)"),
                        ("SCALE_FIX", "expected NAME=VALUE")):
        p = evoattn("eval", str(f), *FAST, "--set", bad)
        assert p.returncode == 4 and needle in p.stderr, p.stderr


@pytest.mark.parametrize("name, code, needle", [
    ("syntax_error.py", 2, "syntax error"),
    ("raises_at_import.py", 2, "raised at import: RuntimeError: no GPU driver found"),
    ("no_entry.py", 2, "defines no function attention()"),
    ("raises_in_call.py", 1 + 2, "raised ValueError: unsupported head dim"),
])
def test_broken_candidates_get_a_verdict_and_reason(name: str, code: int, needle: str) -> None:
    p = evoattn("eval", str(CANDS / name), *FAST)
    assert p.returncode == code, p.stdout + p.stderr
    assert needle in p.stdout
    assert "Traceback" not in p.stdout + p.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_build_error_is_a_build_verdict() -> None:
    p = evoattn("eval", str(CANDS / "broken.cu"), "--device", "cpu")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "build_error" in p.stdout and "not_declared_anywhere" in p.stdout


@pytest.mark.parametrize("args, needle, code", [
    (["eval", "does/not/exist.py"], "does/not/exist.py: file not found", 4),
    (["eval", "pyproject.toml"], "expected a .py (Python/Triton) or .cu (CUDA) file", 4),
    (["eval", "seeds/sdpa/naive_torch.py", "--problem", "nope"], "unknown problem 'nope'", 4),
    (["eval", "seeds/sdpa/naive_torch.py", "--configs", "1,2,x,64"], "--configs", 4),
    (["run", "--config", "missing.yaml"], "missing.yaml: config file not found", 4),
    (["export", "no_such_run", "--out", "x"], "no_such_run: not a run directory", 4),
    # not bad usage but a tool error: the output path is taken by a file
    (["run", "--config", "configs/cpu.yaml", "--output", "pyproject.toml"], "File exists", 1),
])
def test_bad_input_is_one_line_and_its_exit_code(args: list[str], needle: str, code: int) -> None:
    p = evoattn(*args)
    assert p.returncode == code, p.stdout + p.stderr
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_malformed_yaml_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("iterations: 3\nmutators: [kind: knobs\n")
    p = evoattn("run", "--config", str(bad))
    assert p.returncode == 4 and str(bad) in p.stderr and "malformed YAML" in p.stderr


def test_problems_lists_the_sdpa_contract() -> None:
    p = evoattn("problems")
    assert p.returncode == 0 and "sdpa" in p.stdout and "evoattn_sdpa" in p.stdout


def test_baseline_times_every_backend_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "baseline.json"
    p = evoattn("baseline", "--device", "cpu", "--configs", "1,2,64,64,nc", "--json", str(out))
    assert p.returncode == 0, p.stderr
    for name in ("sdpa", "math", "naive"):
        assert name in p.stdout
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1
    for name in ("sdpa", "math", "naive"):
        times = rows[0]["times"][name]
        for mode in ("kernel_ms", "call_ms", "host_us"):
            assert isinstance(times[mode], float) and times[mode] > 0, (name, mode, times)
        assert times["graph_ms"] is None and "GPU" in times["graph_error"]


def test_no_screen_reports_every_failing_config(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    p = evoattn("eval", str(CANDS / "wrong_scale.py"), "--device", "cpu", "--configs",
                "1,2,64,64", "--trials", "1", "--no-screen", "--json", str(out))
    assert p.returncode == 1
    verdicts = [c["verdict"] for c in json.loads(out.read_text())["configs"]]
    assert verdicts == ["incorrect", "incorrect"]          # screened, the second is "skipped"


def test_eval_checks_every_dtype_given_and_times_the_first(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    p = evoattn("eval", str(ROOT / "seeds/sdpa/naive_torch.py"), *FAST, "--dtype", "bfloat16",
                "--dtype", "float16", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Correctness: PASS in bfloat16, float16, timed in bfloat16" in p.stdout
    data = json.loads(out.read_text())
    assert data["dtypes"] == ["bfloat16", "float16"]
    assert {c["dtype"] for c in data["configs"]} == {"bfloat16"} and data["fitness"] > 0
    p = evoattn("eval", str(CANDS / "bf16_as_fp16_bits.py"), *FAST, "--dtype", "float16",
                "--dtype", "bfloat16", "--json", str(out))
    assert p.returncode == 1, p.stdout + p.stderr
    data = json.loads(out.read_text())
    assert data["verdict"] == "incorrect" and data["reason"].startswith("bfloat16: ")
    assert data["configs"][0]["dtype"] == "bfloat16" and data["fitness"] == 0.0
    p = evoattn("eval", str(CANDS / "bf16_as_fp16_bits.py"), *FAST, "--dtype", "float16")
    assert p.returncode == 0, p.stdout + p.stderr
