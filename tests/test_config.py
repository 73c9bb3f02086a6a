"""Strict config loading: every mistake is one error naming the file and the key."""
from __future__ import annotations

from pathlib import Path

import pytest

from evoattn.config import RunConfig, config_from_dict, config_to_dict, load_config
from evoattn.errors import ConfigError


def _write(tmp: Path, text: str) -> Path:
    p = tmp / "c.yaml"
    p.write_text(text)
    return p


def test_shipped_configs_load(repo_root: Path) -> None:
    for p in sorted((repo_root / "configs").glob("*.yaml")):
        cfg = load_config(p)
        assert isinstance(cfg, RunConfig)


def test_defaults_fill_missing_keys(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "iterations: 7\nevaluator:\n  trials: 2\n"))
    assert cfg.iterations == 7 and cfg.evaluator.trials == 2
    assert cfg.evaluator.reps == RunConfig().evaluator.reps
    assert cfg.mutators[0].kind == "knobs"


@pytest.mark.parametrize("text, needle", [
    ("iteratons: 5\n", "unknown key 'iteratons'"),
    ("population:\n  islandz: 2\n", "unknown key 'population.islandz'"),
    ("iterations: many\n", "key 'iterations' must be an integer"),
    ("iterations: true\n", "key 'iterations' must be an integer"),
    ("evaluator:\n  trials: 1.5\n", "key 'evaluator.trials' must be an integer"),
    ("mutators:\n  - kind: magic\n", "key 'mutators[0].kind' must be 'knobs' or 'llm'"),
    ("mutators:\n  - kind: knobs\n    wieght: 1\n", "unknown key 'mutators[0].wieght'"),
    ("llm:\n  models:\n    - name: x\n      price: 3\n", "unknown key 'llm.models[0].price'"),
    ("device: tpu\n", "key 'device' must be one of"),
    ("evaluator:\n  policy: anything\n", "key 'evaluator.policy'"),
    ("configs: 2,32,2048,64\n", "key 'configs' must be a list"),
    ("[1, 2]\n", "top level must be a mapping"),
    ("iterations: [unclosed\n", "malformed YAML"),
    ("llm:\n  models:\n    - {name: x, context_tokens: 512}\n",
     "key 'llm.models[0].context_tokens' must be >= 1024"),
    ("llm:\n  models:\n    - {name: x, base_url: 'localhost:8000/v1'}\n",
     "key 'llm.models[0].base_url' must be an http:// or https:// URL"),
    ("llm:\n  max_consecutive_failures: 0\n", "key 'llm.max_consecutive_failures' must be >= 1"),
    ("llm:\n  feedback_wait_s: -1\n", "key 'llm.feedback_wait_s' must be >= 0"),
])
def test_mistakes_name_the_file_and_key(tmp_path: Path, text: str, needle: str) -> None:
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and needle in str(e.value)
    assert "\n" not in str(e.value)


def test_a_key_pasted_into_api_key_env_is_refused_without_echoing_it(tmp_path: Path) -> None:
    p = _write(tmp_path, "llm:\n  models:\n    - name: m\n      api_key_env: sk-live-Abc123\n")
    with pytest.raises(ConfigError, match=r"llm.models\[0\].api_key_env' must be the NAME") as e:
        load_config(p)
    assert "Abc123" not in str(e.value)


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_round_trips_through_a_dict() -> None:
    cfg = RunConfig(configs=("1,8,512,64",), iterations=3)
    assert config_from_dict(config_to_dict(cfg)) == cfg
