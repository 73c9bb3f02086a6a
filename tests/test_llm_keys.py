"""API keys go only where they are meant: the provider table, and a run against a real HTTP
server on 127.0.0.1 that records every Authorization header it receives."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from rich.console import Console

from evoattn import runner, slots
from evoattn.config import ModelConfig
from evoattn.errors import UsageError
from evoattn.mutators.keys import NO_KEY, check_destination, key_env, resolve_key
from fakes import TOY_SEED, FakeEvaluator
from llm_server import LlmServer, reply

SECRET = "sk-proj-KEEP-THIS-HOME-0123456789abcdef"
EDIT = ("<<<<<<< SEARCH\nSTAGES = 2  # evoattn: choice(1, 2, 3, 4)\n=======\n"
        "STAGES = 2  # evoattn: choice(1, 2, 3, 4)\nEXTRA = 1\n>>>>>>> REPLACE\n")


@pytest.mark.parametrize("url, env, allow, refused", [
    (None, "OPENAI_API_KEY", False, False),
    ("https://api.openai.com/v1", "OPENAI_API_KEY", False, False),
    ("http://127.0.0.1:8000/v1", "OPENAI_API_KEY", False, True),
    ("http://gpu-box.lan:8000/v1", "OPENAI_API_KEY", False, True),
    ("https://api.openai.com.evil.example/v1", "OPENAI_API_KEY", False, True),
    ("http://gpu-box.lan:8000/v1", "OPENAI_API_KEY", True, False),
    ("https://api.groq.com/openai/v1", "OPENAI_API_KEY", False, True),
    ("https://api.groq.com/openai/v1", "GROQ_API_KEY", False, False),
    ("https://api.openai.com/v1", "ANTHROPIC_API_KEY", False, True),
    ("https://my.openai.azure.com/openai", "AZURE_OPENAI_API_KEY", False, False),
    ("https://openrouter.ai/api/v1", "OPENROUTER_API_KEY", False, False),
    ("http://gpu-box.lan:8000/v1", "VLLM_BOX_KEY", False, False),   # claims no provider
])
def test_a_key_variable_naming_a_provider_goes_only_to_that_provider(
        url: str | None, env: str, allow: bool, refused: bool) -> None:
    m = ModelConfig(name="m", base_url=url, api_key_env=env, allow_key_to_other_host=allow)
    if refused:
        with pytest.raises(UsageError, match=f"api_key_env {env} is a key for .*, and base_url"):
            check_destination(m, "llm.models[0]")
    else:
        check_destination(m, "llm.models[0]")


def test_without_api_key_env_only_a_known_provider_gets_its_own_key() -> None:
    assert key_env(ModelConfig(name="m")) == "OPENAI_API_KEY"
    assert key_env(ModelConfig(name="m", base_url="https://api.groq.com/openai/v1")) == \
        "GROQ_API_KEY"
    for url in ("http://127.0.0.1:8000/v1", "http://gpu-box.lan:8000/v1"):
        m = ModelConfig(name="m", base_url=url)
        assert key_env(m) is None
        assert resolve_key(m, {"OPENAI_API_KEY": SECRET}, "x") == NO_KEY
    with pytest.raises(UsageError, match="OPENAI_API_KEY is not set.*api.openai.com"):
        resolve_key(ModelConfig(name="m"), {}, "llm.models[0]")


def _config(tmp: Path, model: dict) -> Path:
    (tmp / "seed.py").write_text(TOY_SEED)
    cfg = {"seed": "seed.py", "device": "cpu", "iterations": 1, "output": str(tmp / "run"),
           "mutators": [{"kind": "llm"}],
           "llm": {"models": [{"name": "m", **model}], "timeout_s": 2, "max_retries": 0}}
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "c.yaml"


def _start(config: Path) -> int:
    return runner.start_run(config_path=str(config), iterations=None, output=None,
                            random_seed=None, device=None, resume_dir=None, quiet=True,
                            console=Console(quiet=True))


@pytest.fixture(autouse=True)
def _fake_evaluator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots, "SubprocessEvaluator", lambda *_, **__: FakeEvaluator())
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)


def test_an_openai_key_named_for_a_local_server_is_refused_before_anything_is_made(
        tmp_path: Path) -> None:
    with LlmServer() as srv:
        cfg = _config(tmp_path, {"base_url": srv.base_url, "api_key_env": "OPENAI_API_KEY"})
        with pytest.raises(UsageError, match="OPENAI_API_KEY is a key for OpenAI, and base_url http://127.0.0.1"):
            _start(cfg)
        assert srv.requests == [] and srv.gets == []
    assert not (tmp_path / "run").exists()


def test_a_local_server_without_api_key_env_never_receives_the_openai_key(
        tmp_path: Path) -> None:
    with LlmServer(models={"m": {"max_model_len": 65536}}) as srv:
        srv.push(reply(EDIT))
        assert _start(_config(tmp_path, {"base_url": srv.base_url})) == 0
        seen = srv.requests + srv.gets
    assert len(srv.requests) == 1 and len(srv.gets) >= 1       # a chat call and the listing
    assert all(SECRET not in str(r.headers) and SECRET not in str(r.body) for r in seen)
    assert {r.headers.get("authorization") for r in seen} == {f"Bearer {NO_KEY}"}


def test_allow_key_to_other_host_sends_the_key_where_the_config_says(tmp_path: Path) -> None:
    with LlmServer() as srv:
        srv.push(reply(EDIT))
        cfg = _config(tmp_path, {"base_url": srv.base_url, "api_key_env": "OPENAI_API_KEY",
                                 "allow_key_to_other_host": True})
        assert _start(cfg) == 0
    assert srv.requests[0].headers["authorization"] == f"Bearer {SECRET}"
    for f in (tmp_path / "run").rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f
