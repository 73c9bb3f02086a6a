"""`evoattn run` end to end on the CPU (Triton interpreter): knobs, LLM over real HTTP, resume, export."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from llm_server import LlmServer, error, reply, stall
from rundb import query

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "seeds" / "sdpa" / "flash_triton.py"
SECRET = "sk-evoattn-test-0123456789abcdefSECRET"


def _config(tmp: Path, **over: object) -> Path:
    cfg = {"problem": "sdpa", "seed": str(SEED), "configs": ["1,2,64,64,nc"], "device": "cpu",
           "iterations": 3, "random_seed": 0, "output": str(tmp / "run"),
           "population": {"islands": 2, "elites_per_island": 4, "migration_interval": 2},
           "evaluator": {"trials": 1, "run_timeout_s": 300}}
    cfg.update(over)
    p = tmp / "config.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _evoattn(*args: str, env: dict | None = None, timeout: int = 900
             ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoattn.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})



def test_knob_search_runs_exports_and_the_export_gets_the_same_verdict(tmp_path: Path) -> None:
    cfg = _config(tmp_path, dtypes=["float16", "float32"])      # checked in both, timed in float16
    p = _evoattn("run", "--config", str(cfg), "--quiet")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "CPU" in p.stdout and "stopped after iteration 3: iterations" in p.stdout
    said = " ".join(p.stdout.split())                           # lines wrap at 200 columns
    assert "--dtype float16 --dtype float32 " in said           # the re-check command
    assert re.search(r"then `import evoattn_sdpa_[0-9a-f]+`", said), said
    assert re.search(r"evaluations: [1-4], \d+\.\d s each on average \(\w+ \d", p.stdout), p.stdout
    run = tmp_path / "run"
    rows = query(run / "run.sqlite", "SELECT iteration, verdict, mutator FROM programs")
    assert rows[0][:2] == (0, "pass") and len(rows) + query(
        run / "run.sqlite", "SELECT count(*) FROM rejections")[0][0] == 4
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][0] == "start" and events[-1]["event"] == "stop"
    best = run / "best" / "best.py"
    assert best.is_file() and (run / "best" / "leaderboard.md").is_file()
    # export again through the command, then re-check the exported kernel
    out = tmp_path / "exported"
    assert _evoattn("export", str(run), "--out", str(out)).returncode == 0
    stored = json.loads((out / "best_eval.json").read_text())
    assert stored["dtypes"] == ["float16", "float32"]
    verified = json.loads(next(out.glob("evoattn_sdpa_*/kernel.json")).read_text())["verified"]
    assert verified["dtypes"] == ["float16", "float32"]
    again = _evoattn("eval", str(out / "best.py"), "--device", "cpu", "--configs", "1,2,64,64,nc",
                     "--trials", "1", "--json", str(tmp_path / "again.json"))
    assert again.returncode == 0, again.stdout
    assert json.loads((tmp_path / "again.json").read_text())["verdict"] == stored["verdict"] \
        == "pass"


def test_a_cpu_run_of_the_hybrid_never_spends_an_evaluation_on_its_cuda_knobs(
        tmp_path: Path) -> None:
    """On the CPU the hybrid's CUDA companion and routing knobs, and the Triton knobs only a GPU
    runs, run no call (their when(...) conditions): the runner tells the mutator the target, so
    no candidate changes them."""
    from evoattn.contract import program
    from evoattn.contract.knobs import active, find_knobs
    hybrid = ROOT / "seeds" / "sdpa" / "flash_hybrid.py"
    knobs = find_knobs(program.read(hybrid))
    dead = {k.key for k in knobs} - {k.key for k in active(knobs, {"target": "cpu"})}
    assert {"CUDA_D128", "USE_TMA", "PINGPONG"} <= dead
    cfg = _config(tmp_path, seed=str(hybrid), iterations=8)
    p = _evoattn("run", "--config", str(cfg), "--quiet")
    assert p.returncode == 0, p.stdout + p.stderr
    changes = [c for (c,) in query(tmp_path / "run" / "run.sqlite",
                                   "SELECT change FROM programs WHERE iteration > 0")]
    assert len(changes) >= 6
    changed = {m for c in changes for m in re.findall(r"([\w.:]+): \S+ -> ", c)}
    assert changed and not changed & dead, changes


def test_kill_9_mid_run_then_resume_continues_the_same_run(tmp_path: Path) -> None:
    cfg = _config(tmp_path, iterations=5)
    db = tmp_path / "run" / "run.sqlite"
    proc = subprocess.Popen([sys.executable, "-m", "evoattn.cli", "run", "--config", str(cfg),
                             "--quiet"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        if db.is_file() and query(db, "SELECT count(*) FROM programs")[0][0] >= 2:
            break
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = json.loads(query(db, "SELECT value FROM state WHERE key='iteration'")[0][0])
    assert 1 <= done < 5
    before = {r[0] for r in query(db, "SELECT id FROM programs")}
    p = _evoattn("run", "--config", str(cfg), "--quiet")   # same output: continues
    assert p.returncode == 0, p.stdout + p.stderr
    after = query(db, "SELECT id, iteration FROM programs")
    assert before <= {r[0] for r in after}
    assert json.loads(query(db, "SELECT value FROM state WHERE key='iteration'")[0][0]) == 5
    assert len({r[0] for r in after}) == len(after)            # nothing evaluated twice
    assert f"[{done + 1}/5]" in p.stdout                     # resumed after the last commit
    # a different config on the same output is refused, nothing lost
    other = _config(tmp_path, iterations=5, random_seed=9)
    q = _evoattn("run", "--config", str(other))
    assert q.returncode == 4 and "different config" in q.stderr
    assert len(query(db, "SELECT id FROM programs")) == len(after)


def _block_n_edits() -> tuple[str, str]:
    """Two LLM replies' edits of the seed's BLOCK_N_D64 line, each to one of the two values it
    does not have (whatever the seed's default is now)."""
    line = next(l for l in SEED.read_text().splitlines() if l.startswith("BLOCK_N_D64 = "))
    current = line.split("=")[1].split("#")[0].strip()
    first, second = [v for v in ("32", "64", "128") if v != current]
    return tuple(f"<<<<<<< SEARCH\n{line}\n=======\n"
                 f"{line.replace(f'= {current}  #', f'= {v}  #')}\n>>>>>>> REPLACE\n"
                 for v in (first, second))


def test_llm_search_over_a_real_http_server(tmp_path: Path) -> None:
    first, second = _block_n_edits()
    malformed = ("<<<<<<< SEARCH\nBLOCK_Q = 999\n=======\nBLOCK_Q = 1\n>>>>>>> REPLACE\n")
    with LlmServer() as srv:
        srv.push(reply(first, 1200, 300), reply(malformed, 1000, 100),
                 error(429, retry_after="0"), stall(3.0, reply("late")),
                 reply(second, 900, 200))
        cfg = _config(tmp_path, iterations=3, mutators=[{"kind": "llm", "weight": 1.0}],
                      llm={"models": [{"name": "scripted", "base_url": srv.base_url,
                                       "api_key_env": "EVOATTN_TEST_KEY",
                                       "price_in_per_mtok": 1.0, "price_out_per_mtok": 2.0}],
                           "timeout_s": 1.0, "max_retries": 3, "backoff_s": 0.05,
                           "concurrency": 0, "budget_usd": 1.0},
                      population={"islands": 1, "elites_per_island": 1})
        p = _evoattn("run", "--config", str(cfg), "--quiet",
                     env={"EVOATTN_TEST_KEY": SECRET, "OPENAI_API_KEY": SECRET})
        requests = list(srv.requests)
    assert p.returncode == 0, p.stdout + p.stderr
    db = tmp_path / "run" / "run.sqlite"
    progs = query(db, "SELECT mutator, change FROM programs WHERE iteration > 0")
    rej = query(db, "SELECT reason FROM rejections")
    calls = query(db, "SELECT model, prompt_tokens, completion_tokens, cost_usd, attempts "
                      "FROM llm_calls ORDER BY iteration")
    assert any("BLOCK_N_D64" in c for _, c in progs) and all(m.startswith("llm") for m, _ in progs)
    assert any("BLOCK_Q = 999" in r or "not found" in r for (r,) in rej), rej
    assert calls[0][:3] == ("scripted", 1200, 300) and abs(calls[0][3] - 0.0018) < 1e-9
    assert max(c[4] for c in calls) >= 2                     # the 429 / stall were retried
    assert requests[0].headers.get("authorization") == f"Bearer {SECRET}"
    # one island, one elite: the same parent again, so the rejection reason is fed back
    assert "BLOCK_Q = 999" not in requests[0].prompt
    assert any("BLOCK_Q = 999" in r.prompt for r in requests[2:])
    # the key never reaches the run directory or the logs
    for f in (tmp_path / "run").rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f
    assert SECRET not in p.stdout + p.stderr
