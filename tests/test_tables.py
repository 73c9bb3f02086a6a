"""benchmarks/tables.py: the tables BENCHMARKS.md quotes are computed from the result files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _result(path: Path, fitness: float, rows: list[tuple[float, float]]) -> Path:
    configs = [{"params": {"B": 1, "H": 2, "S": 128 * (i + 1), "D": 64, "causal": bool(i % 2)},
                "verdict": "pass", "ms": ms, "baseline_ms": base, "speedup": base / ms,
                "tflops": 1.0 / ms, "baseline_tflops": 1.0 / base}
               for i, (ms, base) in enumerate(rows)]
    path.write_text(json.dumps({"candidate": path.stem, "verdict": "pass", "reason": "",
                                "fitness": fitness, "device": "X", "versions": {},
                                "configs": configs}))
    return path


def _tables(*args: str) -> str:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tables.py"), *args],
                          capture_output=True, text=True, check=True).stdout


def test_compare_gives_each_config_its_seed_and_best_speedup_and_gain(tmp_path) -> None:  # noqa: ANN001
    seed = _result(tmp_path / "seed.json", 0.5, [(2.0, 1.0), (4.0, 1.0)])
    best = _result(tmp_path / "best.json", 0.9, [(1.0, 1.0), (1.0, 0.8)])
    out = _tables("compare", str(seed), str(best))
    assert "seed fitness 0.500 -> best fitness 0.900" in out
    rows = [line for line in out.splitlines() if line.startswith("| (1,2,")]
    assert rows[0].endswith("| 2.00× |") and "| 0.500 |" in rows[0] and "| 1.000 |" in rows[0]
    assert "(1,2,256,64) causal" in rows[1] and rows[1].endswith("| 4.00× |")
    assert "| 0.800 |" in rows[1]


def test_summary_lists_every_file_with_its_fitness(tmp_path) -> None:  # noqa: ANN001
    a = _result(tmp_path / "a.json", 0.25, [(4.0, 1.0)])
    b = _result(tmp_path / "b.json", 2.0, [(1.0, 2.0)])
    out = _tables("summary", str(a), str(b))
    assert "| `a.json` | a | pass | 0.2500 | 0.250 |" in out
    assert "| `b.json` | b | pass | 2.0000 | 2.000 |" in out
