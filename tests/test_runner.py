"""`start_run` wiring with the fake evaluator: resume from anywhere, devices, budget, exit."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from evoattn import runner, settings, slots
from evoattn.errors import ConfigError, EvoattnError, RunDirError, UsageError
from fakes import TOY_SEED, FakeEvaluator


@pytest.fixture(autouse=True)
def fake_evaluator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots, "SubprocessEvaluator", lambda *_, **__: FakeEvaluator())


def _config(tmp: Path, **over: object) -> Path:
    d = tmp / "cfg"
    d.mkdir(exist_ok=True)
    (d / "seed.py").write_text(TOY_SEED)
    cfg = {"seed": "seed.py", "device": "cpu", "iterations": 2, "output": str(tmp / "run")}
    cfg.update(over)
    (d / "c.yaml").write_text(yaml.safe_dump(cfg))
    return d / "c.yaml"


def _start(config: Path | None = None, **kw: object) -> None:
    args = dict(config_path=str(config) if config else None, iterations=None, output=None,
                random_seed=None, device=None, resume_dir=None, quiet=True,
                console=Console(quiet=True))
    args.update(kw)
    runner.start_run(**args)


def _iteration(run: Path) -> int:
    con = sqlite3.connect(run / "run.sqlite")
    try:
        return json.loads(con.execute("SELECT value FROM state WHERE key='iteration'")
                          .fetchone()[0])
    finally:
        con.close()


def test_resume_works_from_another_directory(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(tmp_path)                 # the seed path is relative to the config
    _start(cfg)
    monkeypatch.chdir(tmp_path)
    _start(resume_dir=str(tmp_path / "run"), iterations=4)
    assert _iteration(tmp_path / "run") == 4


def test_a_cpu_run_does_not_continue_on_the_gpu(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(tmp_path)
    _start(cfg)
    monkeypatch.setattr(settings, "detect_device", lambda: "cuda")   # as on a GPU machine
    with pytest.raises(RunDirError, match="timed on cpu; it cannot continue on cuda"):
        _start(cfg, device="cuda", iterations=4)
    assert _iteration(tmp_path / "run") == 2


def test_asking_for_cuda_without_a_gpu_is_a_usage_error(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings, "detect_device", lambda: "cpu")
    with pytest.raises(UsageError, match="--device cuda: no NVIDIA GPU is visible"):
        _start(_config(tmp_path), device="cuda")
    assert not (tmp_path / "run").exists()              # refused before anything is created


def test_command_line_overrides_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'iterations' must be >= 0"):
        _start(_config(tmp_path), iterations=-1)


def test_resume_refuses_a_config_or_output_it_would_ignore(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _start(cfg)
    with pytest.raises(UsageError, match="takes no --config or --output"):
        _start(cfg, resume_dir=str(tmp_path / "run"))


def test_an_incorrect_seed_is_an_error_not_success(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots, "SubprocessEvaluator",
                        lambda *_, **__: FakeEvaluator(fail_when={"BLOCK_M": "64"}))
    with pytest.raises(EvoattnError, match="no correct program.*seed is not correct"):
        _start(_config(tmp_path))


def test_the_llm_budget_counts_spend_from_before_a_resume(tmp_path: Path) -> None:
    cfg = _config(tmp_path, iterations=0, mutators=[{"kind": "llm"}],
                  llm={"models": [{"name": "m", "base_url": "http://127.0.0.1:9/v1"}],
                       "budget_usd": 1.0, "max_retries": 0, "timeout_s": 1.0})
    _start(cfg)
    con = sqlite3.connect(tmp_path / "run" / "run.sqlite")
    with con:                               # an earlier session spent more than the budget
        con.execute("INSERT INTO llm_calls VALUES (1, 'm', 10, 10, 2.0, 1.0, 1, 'ok', 'x')")
    con.close()
    _start(cfg, iterations=3)
    events = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    assert json.loads(events[-1])["reason"] == "LLM budget exhausted"
    assert _iteration(tmp_path / "run") == 0


def test_the_evaluator_is_closed_when_the_run_ends(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[FakeEvaluator] = []
    monkeypatch.setattr(slots, "SubprocessEvaluator",
                        lambda *_, **__: made.append(FakeEvaluator()) or made[-1])
    _start(_config(tmp_path))
    assert len(made) == 1 and made[0].closed and made[0].calls


def test_the_run_passes_its_evaluator_settings_to_the_sandbox(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []
    monkeypatch.setattr(slots, "SubprocessEvaluator",
                        lambda request, sandbox, plain=None: seen.append((request, sandbox,
                                                                          plain)) or
                        FakeEvaluator())
    cfg = _config(tmp_path, evaluator={"policy": "allow-library", "reps": 50, "trials": 2},
                  llm={"models": [{"name": "m", "api_key_env": "TORCH_MY_KEY"}]})
    _start(cfg)
    ((r, s, plain),) = seen
    assert plain == {"width": 0.01, "graph": False, "heat": False}
    assert s.gpu_share == 1                                  # on the CPU: one
    assert r.policy == "allow-library" and r.trials == 2 and r.device == "cpu"
    assert (r.resolved_reps(), r.resolved_warmup()) == (4, 1)   # CPU: two pairs of rounds
    assert r.timing == "call" and r.baseline == "best"
    assert (r.tolerance_factor, r.tolerance_floor) == (None, None)  # the problem's own rule
    assert "TORCH_MY_KEY" in s.secret_env_names    # on the allow-list, so only this drops it
