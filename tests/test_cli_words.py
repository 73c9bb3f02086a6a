"""What the CLI says: option names and help, the user's file names, no score for nothing
scored, and hints that print whole into a file."""
from __future__ import annotations

import io
import random
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from rich.console import Console

from evoattn.contract.types import ConfigResult, EvalResult, Verdict
from evoattn import cli, report
from evoattn.config import RunConfig, config_to_dict
from evoattn.store import RunStore
from evoattn.types import Program

ROOT = Path(__file__).resolve().parent.parent


def _evoattn(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoattn.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def _commands(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    out = []
    for name, cmd in group.commands.items():
        out.append((prefix + name, cmd))
        if isinstance(cmd, click.Group):
            out += _commands(cmd, f"{prefix}{name} ")
    return out


def test_every_option_of_every_command_has_help() -> None:
    missing = [f"{name} {opt.opts[0]}" for name, cmd in _commands(cli.cli)
               for opt in cmd.params
               if isinstance(opt, click.Option) and not opt.hidden and not opt.help]
    assert not missing, missing
    assert len(_commands(cli.cli)) >= 8                   # every command was looked at


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Stands in for the run itself: records what `evoattn run` asked for."""
    import evoattn.runner
    asked: dict = {}

    def start_run(**kw: object) -> int:
        asked.update(kw)
        return 0
    monkeypatch.setattr(evoattn.runner, "start_run", start_run)
    return asked


def test_random_seed_sets_the_rng_and_old_seed_still_takes_an_integer(started: dict) -> None:
    r = CliRunner().invoke(cli.cli, ["run", "--random-seed", "7"])
    assert r.exit_code == 0 and started["random_seed"] == 7
    r = CliRunner().invoke(cli.cli, ["run", "--seed", "9"])
    assert r.exit_code == 0 and started["random_seed"] == 9
    shown = CliRunner().invoke(cli.cli, ["run", "--help"]).output
    assert "--random-seed" in shown and "--seed " not in shown           # the old name hidden


def test_old_seed_given_a_path_says_which_option_is_which() -> None:
    p = _evoattn("run", "--seed", "seeds/x.py")
    assert p.returncode == 4
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "--random-seed" in lines[0] and "seed: in the config" in lines[0]


def _result(verdict: Verdict, reason: str, **kw: object) -> EvalResult:
    return EvalResult(verdict, reason, 0.0, candidate="kernel.cu", **kw)


def test_messages_name_the_users_file_not_the_sandboxs() -> None:
    cfg = ConfigResult({"B": 1, "H": 2, "S": 64, "D": 64}, "float16", Verdict.CRASH,
                       'File "/tmp/evoattn-a1b2/candidate.py", line 4')
    r = _result(Verdict.BUILD_ERROR, "candidate.cu(5): error: identifier x is undefined",
                build_log="/tmp/evoattn-x_1/candidate.cu(5): error\n"
                          "/tmp/evoattn-x_1/rival/rival.cu(2): warning",
                flags=("candidate.cu reads past its inputs",), configs=(cfg,))
    got = report.in_user_terms(r, "my/kernel.cu", "my/old.cu")
    assert got.reason == "my/kernel.cu(5): error: identifier x is undefined"
    assert got.build_log == "my/kernel.cu(5): error\nmy/old.cu(2): warning"
    assert got.flags == ("my/kernel.cu reads past its inputs",)
    assert got.configs[0].reason == 'File "my/kernel.cu", line 4'
    # other words are left alone
    same = _result(Verdict.INCORRECT, "the candidate is wrong; see mycandidate.py")
    assert report.in_user_terms(same, "k.py").reason == same.reason


def _printed(result: EvalResult) -> str:
    buf = io.StringIO()
    report.print_eval(Console(file=buf, width=200), result)
    return buf.getvalue()


def test_a_file_only_compiled_gets_no_score_line_and_a_failure_does() -> None:
    compiled = _printed(_result(Verdict.COMPILED, "kernel.cu: compiled for sm_90a"))
    assert "Compiled: kernel.cu" in compiled and "Score" not in compiled
    failed = _printed(_result(Verdict.BUILD_ERROR, "kernel.cu(5): error"))
    assert "Correctness: FAIL" in failed and "Score: 0.0000" in failed


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_eval_of_a_cu_on_the_cpu_names_the_file_and_prints_no_score() -> None:
    p = _evoattn("eval", "seeds/sdpa/naive.cu", "--device", "cpu")
    assert p.returncode == 6, p.stdout + p.stderr
    assert "Compiled: seeds/sdpa/naive.cu:" in p.stdout
    assert "candidate.cu" not in p.stdout and "Score" not in p.stdout


def test_a_hint_prints_whole_into_a_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    source = "def attention(q, k, v, causal=False, scale=None):\n    return q\n"
    seed = Program("seed", source, ".py", None, 0, 0, "seed", "",
                   EvalResult(Verdict.PASS, "ok", 1.0, device="cpu", timing_device="cpu"))
    with RunStore.open(run, config_to_dict(RunConfig()), create=True) as s:
        s.commit_iteration(iteration=0, program=seed, rejection=None, llm_usage=None,
                           rng_state=random.Random(0).getstate(), population_snapshot={})
    out = tmp_path / ("a-directory-name-long-enough-to-pass-the-width-of-a-line-" * 4) / "best"
    p = _evoattn("export", str(run), "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert any(line.startswith(f"install it with `pip install {out}`, then `import ")
               for line in p.stdout.splitlines()), p.stdout
