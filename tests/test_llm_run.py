"""`evoattn run` with an LLM as a user meets it, against a real HTTP server on 127.0.0.1 (the
evaluator is the fake one): failures that stop and say where, a changed model on resume, paid
calls kept at a budget stop, feedback that survives resume, tokens and cost in quiet output,
and `evoattn llm check`."""
from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from evoattn import runner, slots
from fakes import TOY_SEED, FakeEvaluator
from llm_server import LlmServer, error, reply, stall
from rundb import query

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"name": "m", "price_in_per_mtok": 1.0, "price_out_per_mtok": 2.0}


def edit(n: int) -> str:
    """Returns an answer that adds the line `EXTRA_n = n` after the STAGES knob."""
    return ("Add a line.\n<<<<<<< SEARCH\nSTAGES = 2  # evoattn: choice(1, 2, 3, 4)\n=======\n"
            f"STAGES = 2  # evoattn: choice(1, 2, 3, 4)\nEXTRA_{n} = {n}\n>>>>>>> REPLACE\n")


BAD_EDIT = "<<<<<<< SEARCH\nNOT_IN_THE_SEED = 1\n=======\nX = 2\n>>>>>>> REPLACE\n"
FAILING_EDIT = ("<<<<<<< SEARCH\nBLOCK_N = 32  # evoattn: choice(16, 32, 64)\n=======\n"
                "BLOCK_N = 16  # evoattn: choice(16, 32, 64)\n>>>>>>> REPLACE\n")


@pytest.fixture(autouse=True)
def _fake_evaluator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots, "SubprocessEvaluator",
                        lambda *_, **__: FakeEvaluator(fail_when={"BLOCK_N": "16"}))


def _config(tmp: Path, url: str, iterations: int = 3, model: dict | None = None,
            **llm: object) -> Path:
    (tmp / "seed.py").write_text(TOY_SEED)
    settings = {"models": [{**MODEL, "base_url": url, **(model or {})}], "timeout_s": 2.0,
                "max_retries": 1, "backoff_s": 0.01, "concurrency": 0, **llm}
    cfg = {"seed": "seed.py", "device": "cpu", "iterations": iterations,
           "output": str(tmp / "run"), "population": {"islands": 1, "elites_per_island": 1},
           "mutators": [{"kind": "llm"}], "llm": settings}
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "c.yaml"


def _start(config: Path | None = None, resume: Path | None = None,
           iterations: int | None = None) -> tuple[int, str]:
    out = io.StringIO()
    code = runner.start_run(config_path=str(config) if config else None, iterations=iterations,
                            output=None, random_seed=None, device=None,
                            resume_dir=str(resume) if resume else None, quiet=True,
                            console=Console(file=out, width=300))
    return code, out.getvalue()



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_is_down_stops_the_run_naming_it_and_a_fixed_url_resumes(
        tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{_free_port()}/v1"
    code, out = _start(_config(tmp_path, down, iterations=10, max_consecutive_failures=2))
    assert code == 1
    assert "the LLM stopped the run: 2 calls in a row failed" in out
    assert f"model m at {down}: cannot connect" in out and "Connection refused" in out
    assert "rerun the same command" in out
    run = tmp_path / "run"
    assert query(run, "SELECT count(*) FROM rejections")[0][0] == 2      # then it stopped
    assert query(run, "SELECT count(*) FROM llm_calls WHERE status = 'failed'")[0][0] == 2
    with LlmServer() as srv:                                            # the server is back
        srv.push(*(reply(edit(i)) for i in range(8)))
        code, out = _start(_config(tmp_path, srv.base_url, iterations=10,
                                   max_consecutive_failures=2))
    assert code == 0 and "resuming the run" in out and "the llm section differs" in out
    assert json.loads(query(run, "SELECT value FROM state WHERE key='iteration'")[0][0]) == 10


def test_a_hung_server_costs_two_timeouts_a_call_and_stops_the_run(tmp_path: Path) -> None:
    with LlmServer() as srv:
        srv.push(*(stall(5.0) for _ in range(12)))
        code, out = _start(_config(tmp_path, srv.base_url, iterations=10, timeout_s=0.3,
                                   max_retries=4, max_consecutive_failures=2))
        n = len(srv.requests)
    assert code == 1 and "no answer within timeout_s = 0.3 s" in out
    assert n == 4                              # 2 calls, each given up after its 2nd timeout


def test_a_wrong_model_name_stops_and_the_fixed_name_carries_on_through_resume(
        tmp_path: Path) -> None:
    with LlmServer() as srv:
        srv.push(error(404, "The model `gtp-4.1` does not exist"))
        code, out = _start(_config(tmp_path, srv.base_url, model={"name": "gtp-4.1"}))
        assert code == 1 and f"model gtp-4.1 at {srv.base_url}: HTTP 404" in out
        srv.push(reply(edit(1)), reply(edit(2)), reply(edit(3)))
        code, out = _start(_config(tmp_path, srv.base_url, model={"name": "gpt-4.1"}))
        assert code == 0 and "resuming the run" in out
        code, out = _start(resume=tmp_path / "run", iterations=4)
        assert code == 0
        models = [r.body["model"] for r in srv.requests]
    assert models == ["gtp-4.1", "gpt-4.1", "gpt-4.1", "gpt-4.1"]
    stored = json.loads(query(tmp_path / "run", "SELECT value FROM meta WHERE key='config'")[0][0])
    assert stored["llm"]["models"][0]["name"] == "gpt-4.1"


def test_a_budget_stop_records_every_call_that_was_answered(tmp_path: Path) -> None:
    with LlmServer() as srv:
        srv.push(*(stall(0.3, reply(edit(i), 1000, 50)) for i in range(6)))
        code, out = _start(_config(tmp_path, srv.base_url, iterations=6, concurrency=2,
                                   feedback_wait_s=0, budget_usd=0.0005))
        answered = len(srv.requests)           # each one answered (0.3 s < timeout_s)
    run = tmp_path / "run"
    assert code == 0 and "stopped after iteration" in out and "LLM budget exhausted" in out
    assert answered >= 2                              # calls were in flight at the stop ...
    recorded = query(run, "SELECT count(*), sum(cost_usd) FROM llm_calls")[0]
    assert recorded[0] == answered                    # ... and every one is in the call log
    assert recorded[1] == pytest.approx(answered * 0.0011)


def test_quiet_lines_and_the_summary_show_tokens_and_cost(tmp_path: Path) -> None:
    with LlmServer() as srv:
        srv.push(reply(edit(1), 1000, 50), reply(edit(2), 2000, 100))
        code, out = _start(_config(tmp_path, srv.base_url, iterations=2))
    assert code == 0
    assert "[1/2] best" in out and "LLM 1 calls, 1000 in / 50 out tokens, $0.0011" in out
    assert "LLM 2 calls, 3000 in / 150 out tokens, $0.0033" in out
    assert "LLM: 2 calls, 3000 tokens in, 150 out, $0.0033 (the whole run)" in out


def test_feedback_comes_from_the_store_survives_resume_and_reports_duplicates(
        tmp_path: Path) -> None:
    with LlmServer() as srv:
        # 1: a child that fails; 2: the same edit again (a duplicate); 3: an edit that misses
        srv.push(reply(FAILING_EDIT), reply(FAILING_EDIT), reply(BAD_EDIT))
        code, _ = _start(_config(tmp_path, srv.base_url, iterations=3))
        assert code == 0
        first_session = [r.prompt for r in srv.requests]
        srv.push(reply(edit(4)))
        code, _ = _start(resume=tmp_path / "run", iterations=4)
        prompt = srv.requests[-1].prompt
    assert code == 0
    assert "Already tried" not in first_session[0]
    assert "incorrect: BLOCK_N=16 is wrong" in first_session[1]          # iteration 1's outcome, in iteration 2's prompt
    tried = prompt.split("## Already tried on this program")[1].split("## Your task")[0]
    assert "iteration 1, llm:m: incorrect: BLOCK_N=16 is wrong" in tried
    assert "-BLOCK_N = 32  # evoattn: choice(16, 32, 64)" in tried       # the changed lines
    assert "+BLOCK_N = 16  # evoattn: choice(16, 32, 64)" in tried
    assert "iteration 2, llm:m: gave a program that was already evaluated" in tried
    assert "incorrect, fitness 0" in tried
    assert "iteration 3, llm:m: the answer was not applied: edit block: the SEARCH text " \
           "starting 'NOT_IN_THE_SEED = 1' was not found" in tried


def test_a_prompt_waits_for_a_sibling_in_flight_so_its_outcome_arrives(tmp_path: Path) -> None:
    with LlmServer() as srv:
        srv.push(stall(0.5, reply(BAD_EDIT)), reply(edit(2)), reply(edit(3)))
        code, _ = _start(_config(tmp_path, srv.base_url, iterations=3, concurrency=2,
                                 feedback_wait_s=30))
        prompts = [r.prompt for r in srv.requests]
    assert code == 0 and len(prompts) == 3
    assert "'NOT_IN_THE_SEED = 1' was not found" in prompts[1]


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoattn.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "250", **(env or {})})


def test_llm_check_reports_each_model_and_fails_when_one_is_down(tmp_path: Path) -> None:
    with LlmServer(models={"m": {"max_model_len": 40960}}) as srv:
        srv.push(reply("OK", 12, 1))
        cfg = _config(tmp_path, srv.base_url)
        p = _cli("llm", "check", "--config", str(cfg))
        assert p.returncode == 0, p.stdout + p.stderr
        assert "ok OK; 12 + 1 tokens" in p.stdout and "40960 (server)" in p.stdout
        assert "1 / 2" in p.stdout and "the seed's prompt is about" in p.stdout
        assert srv.requests[0].body["max_tokens"] == 16
        down = f"http://127.0.0.1:{_free_port()}/v1"
        raw = yaml.safe_load(cfg.read_text())
        raw["llm"]["models"].append({"name": "other", "base_url": down, "context_tokens": 8192})
        cfg.write_text(yaml.safe_dump(raw))
        srv.push(reply("OK"))
        p = _cli("llm", "check", "--config", str(cfg))
    assert p.returncode == 1
    assert "failed model other at" in p.stdout and "cannot connect" in p.stdout
    assert "8192 (config)" in p.stdout


def test_llm_check_without_models_to_ask_says_so_and_sends_nothing(tmp_path: Path) -> None:
    with LlmServer() as srv:
        p = _cli("llm", "check")
        assert p.returncode == 0, p.stdout + p.stderr
        assert p.stdout.strip() == ("nothing to check: no --config given (`evoattn llm check "
                                    "--config C.yaml` asks each model of C's llm: section)")
        cfg = _config(tmp_path, srv.base_url)
        raw = yaml.safe_load(cfg.read_text())
        del raw["llm"]
        raw["mutators"] = [{"kind": "knobs"}]
        cfg.write_text(yaml.safe_dump(raw))
        p = _cli("llm", "check", "--config", str(cfg),
                 env={"OPENAI_API_KEY": ""})   # the default model would fail on its key
        assert p.returncode == 0, p.stdout + p.stderr
        assert p.stdout.strip() == f"nothing to check: {cfg} has no llm: section"
        assert "gpt-4o-mini" not in p.stdout + p.stderr
        p = _cli("llm", "check", "--config", str(ROOT / "configs/default.yaml"))
        assert p.returncode == 0 and "has no llm: section" in p.stdout
        raw["llm"] = {"models": []}
        cfg.write_text(yaml.safe_dump(raw))
        p = _cli("llm", "check", "--config", str(cfg))
        assert p.returncode == 0 and p.stdout.strip() == f"nothing to check: {cfg} has no llm.models"
        assert srv.requests == [] and srv.gets == []


def test_llm_check_with_a_bad_config_is_one_line_and_exit_4(tmp_path: Path) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text("llm:\n  modles: []\n")
    p = _cli("llm", "check", "--config", str(bad))
    assert p.returncode == 4 and "unknown key 'llm.modles'" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
