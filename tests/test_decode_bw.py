"""benchmarks.decode_bw on the CPU (Triton's interpreter): its checks and its JSON. The GPU
modes (the clean-L2 event timing, the streaming-read reference, CUDA graphs) run on a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE = "benchmarks.decode_bw"

WRONG = '''import torch
def attention(q, k, v, cache_seqlens, scale=None):
    return torch.zeros_like(q)
'''


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bw.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", MODULE, "--device", "cpu", "--out", str(out),
                           "--no-baselines", "--rounds", "1", *args],
                          capture_output=True, cwd=ROOT, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_seed_is_checked_and_timed_and_a_wrong_rival_is_not_timed(tmp_path):
    rival = tmp_path / "zeros.py"
    rival.write_text(WRONG)
    data = _run(tmp_path, "--rival", str(rival))
    assert data["rows"], "no config measured"
    for row in data["rows"]:
        seed, bad = row["results"]["seed"], row["results"]["rival"]
        assert seed["ok"] and seed["err"] <= row["bound"]
        assert seed["do_bench_us"] > 0 and seed["eager_us"] > 0
        assert "clean_us" not in seed and "stream_us" not in row    # GPU-only modes
        assert bad["ok"] is False and "do_bench_us" not in bad
        assert not any(k.startswith("speedup_vs_rival") for k in row)
    assert row["bytes"] > 2 * row["sum_lengths"] * 2    # at least the valid cache, 16-bit
