"""benchmarks.make_page: BENCHMARKS.md's tables are computed from `evoattn eval --json` files
and a run's store, with the evaluator's fitness rule."""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

from evoattn.contract.types import ConfigResult, EvalResult, Times, Verdict
from evoattn.config import RunConfig, config_to_dict
from evoattn.store import RunStore
from evoattn.types import Program

ROOT = Path(__file__).resolve().parent.parent
MODES = ("call", "kernel", "graph")


def _times(call: float, kernel: float, graph: float, host: float) -> Times:
    return Times(call_ms=call, kernel_ms=kernel, graph_ms=graph, host_us=host)


def _result(scale: float = 1.0, **kw) -> EvalResult:
    """Two configs, two baselines: `fast` is the fastest in every mode but one (graph time of
    the second config, where `slow` wins). The candidate's ratios differ per mode, and a
    ratio taken the wrong way round or a product instead of a mean gives other numbers.
    `scale` divides the candidate's times (a faster candidate)."""
    configs = []
    for i, (mine, fast, slow) in enumerate([((1.0, 0.5, 0.4, 30.0), (2.0, 1.0, 0.8, 20.0),
                                             (4.0, 2.0, 1.6, 10.0)),
                                            ((4.0, 0.25, 2.0, 40.0), (1.0, 0.5, 2.0, 20.0),
                                             (3.0, 3.0, 0.5, 10.0))]):
        configs.append(ConfigResult(
            params={"B": 1, "H": 2, "S": 64 * (i + 1), "D": 64, "causal": i == 1},
            dtype="float16", verdict=Verdict.PASS,
            times=_times(*(t / scale for t in mine[:3]), mine[3]),
            baseline_times={"fast": _times(*fast), "slow": _times(*slow)}))
    return EvalResult(verdict=Verdict.PASS, reason="", fitness=kw.pop("fitness", 0.7),
                      configs=tuple(configs), candidate="seed.py", problem="sdpa",
                      device="GPU X", **kw)


def _eval_json(path: Path, **kw) -> Path:
    """An evaluation as `evoattn eval --json` writes it."""
    path.write_text(json.dumps(_result(**kw).to_json()))
    return path


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    return subprocess.run([sys.executable, "-m", "benchmarks.make_page", *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, env=env)


def test_the_page_gets_per_mode_fitness_against_the_fastest_baseline_and_keeps_its_prose(
        tmp_path: Path) -> None:
    res = tmp_path / "results"
    res.mkdir()
    _eval_json(res / "eval_toy.json")
    (res / "machine.txt").write_text("GPU X, driver 1\ntorch 9\n")
    assert _run("collect", res, "-o", tmp_path / "current.json", cwd=tmp_path).returncode == 0
    current = json.loads((tmp_path / "current.json").read_text())
    fit = current["evals"]["toy"]["fitness"]
    # per config: fastest baseline / candidate, then the geometric mean over configs
    assert math.isclose(fit["call"], math.sqrt((2.0 / 1.0) * (1.0 / 4.0)))     # 0.707
    assert math.isclose(fit["kernel"], math.sqrt((1.0 / 0.5) * (0.5 / 0.25)))  # 2.0
    assert math.isclose(fit["graph"], math.sqrt((0.8 / 0.4) * (0.5 / 2.0)))    # 0.707

    page = tmp_path / "BENCHMARKS.md"
    page.write_text("# Results\n\nprose before\n<!-- tables -->\nold table\n<!-- /tables -->\n"
                    "prose after\n")
    out = _run("page", tmp_path / "current.json", "--page", page, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = page.read_text()
    assert text.startswith("# Results\n\nprose before\n<!-- tables -->\n")
    assert text.endswith("<!-- /tables -->\nprose after\n") and "old table" not in text
    assert "Machine: GPU X, driver 1; torch 9" in text
    assert "call time 0.707×, kernel time 2.000×, graph time 0.707×" in text
    assert "| toy | `seed.py` | fast, slow | 0.707× | 2.000× | 0.707× | – |" in text
    # the first config's row: its times, its host cost, each baseline's ratio in every mode
    assert "| (1,2,64,64) | 1.0000 | 0.5000 | 0.4000 | 30 | 2.00 / 2.00 / 2.00 (host 20) | " \
           "4.00 / 4.00 / 4.00 (host 10) |" in text


def test_a_page_without_the_table_markers_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "current.json").write_text(json.dumps({"evals": {}, "machine": "m"}))
    page = tmp_path / "BENCHMARKS.md"
    page.write_text("# Results\n")
    out = _run("page", tmp_path / "current.json", "--page", page, cwd=tmp_path)
    assert out.returncode == 1 and "no <!-- tables -->" in out.stderr
    assert page.read_text() == "# Results\n"


def test_a_crosscheck_of_the_same_name_adds_its_harness_to_the_summary_and_the_table(
        tmp_path: Path) -> None:
    """crosscheck.py's cc_<name>.json beside eval_<name>.json: the summary's last column is its
    geometric mean and timer, and each config's row gets its speedup, matched by the config's
    parameters (the two scripts label configs differently)."""
    res = tmp_path / "results"
    res.mkdir()
    _eval_json(res / "eval_toy.json")
    (res / "cc_toy.json").write_text(json.dumps({
        "problem": "sdpa", "timer": "do_bench", "geomean": 1.234,
        "configs": [{"config": "B=1,H=2,S=128 whatever", "passed": True, "speedup": 0.5,
                     "params": {"B": 1, "H": 2, "S": 128, "D": 64, "causal": True}},
                    {"config": "first", "passed": True, "speedup": 2.5,
                     "params": {"B": 1, "H": 2, "S": 64, "D": 64, "causal": False}}]}))
    (res / "machine.txt").write_text("GPU X\n")
    assert _run("collect", res, "-o", tmp_path / "current.json", cwd=tmp_path).returncode == 0
    page = tmp_path / "BENCHMARKS.md"
    page.write_text("<!-- tables -->\n<!-- /tables -->\n")
    out = _run("page", tmp_path / "current.json", "--page", page, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = page.read_text()
    assert "| toy | `seed.py` | fast, slow | 0.707× | 2.000× | 0.707× | 1.234× (do_bench) |" in text
    assert "| vs the fastest, do_bench |" in text
    rows = [line for line in text.splitlines() if line.startswith("| (1,2,")]
    assert rows[0].startswith("| (1,2,64,64) |") and rows[0].endswith(" | 2.50 |")
    assert rows[1].startswith("| (1,2,128,64) causal |") and rows[1].endswith(" | 0.50 |")


def test_the_fitness_mode_shows_the_evaluators_own_fitness_and_interval(tmp_path: Path) -> None:
    """Where the evaluation carries its fitness (the median of paired rounds' ratios) and its
    interval, the page shows those in the mode it was timed in, not a ratio of medians; the
    other modes keep the ratio of medians."""
    res = tmp_path / "results"
    res.mkdir()
    _eval_json(res / "eval_toy.json", timing="kernel", fitness=1.9, fitness_ci=(1.85, 1.95))
    (res / "machine.txt").write_text("GPU X\n")
    assert _run("collect", res, "-o", tmp_path / "current.json", cwd=tmp_path).returncode == 0
    page = tmp_path / "BENCHMARKS.md"
    page.write_text("<!-- tables -->\n<!-- /tables -->\n")
    assert _run("page", tmp_path / "current.json", "--page", page, cwd=tmp_path).returncode == 0
    text = page.read_text()
    assert "| toy | `seed.py` | fast, slow | 0.707× | 1.900× [1.850, 1.950] | 0.707× | – |" in text
    assert "call time 0.707×, kernel time 1.900× [1.850, 1.950], graph time 0.707×" in text


def test_a_runs_seed_and_best_come_from_its_store(tmp_path: Path) -> None:
    """run.sqlite beside the evaluations: the seed is iteration 0, the best the fittest stored
    program, each summarised as an evaluation is (a faster candidate: every mode's fitness
    scales with it)."""
    res = tmp_path / "results"
    store = RunStore.open(res, config_to_dict(RunConfig()), create=True)
    for it, (scale, fitness) in enumerate([(1.0, 0.7), (2.0, 1.4), (1.5, 1.05)]):
        store.commit_iteration(
            iteration=it, program=Program(
                id=f"p{it}", source="def attention(): pass\n", suffix=".py",
                parent_id=None if it == 0 else "p0", iteration=it, island=0,
                mutator="seed" if it == 0 else "knobs", change="",
                result=_result(scale, fitness=fitness)),
            rejection=None, llm_usage=None, rng_state=random.Random(it).getstate(),
            population_snapshot={})
    store.close()
    assert _run("collect", res, "-o", tmp_path / "current.json", cwd=tmp_path).returncode == 0
    run = json.loads((tmp_path / "current.json").read_text())["run"]
    assert run["evaluations"] == 3 and run["best_iteration"] == 1
    assert math.isclose(run["seed"]["fitness"]["kernel"], 2.0)
    assert math.isclose(run["best"]["fitness"]["kernel"], 4.0)
    assert math.isclose(run["best"]["fitness"]["call"], 2 * math.sqrt(0.5))
