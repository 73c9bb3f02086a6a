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
    ("dtypes: [float16, fp8]\n",
     "key 'dtypes[1]' must be one of float16, bfloat16, float32, got 'fp8'"),
    ("dtypes: float16\n", "key 'dtypes' must be a list"),
    ("dtypes: []\n", "key 'dtypes' must list at least one of float16, bfloat16, float32"),
    ("dtypes: [bfloat16, bfloat16]\n", "key 'dtypes[1]' names bfloat16 a second time"),
    ("dtypes: [float16, 16]\n", "key 'dtypes[1]' must be a string"),
    ("dtype: half\n", "key 'dtypes[0]' must be one of float16, bfloat16, float32"),
    ("dtype: float16\ndtypes: [float16]\n", "keys 'dtype' and 'dtypes' are both set"),
    ("population:\n  transplant_rate: 1.5\n",
     "key 'population.transplant_rate' must be between 0 and 1"),
    ("population:\n  crossover_rate: -0.1\n",
     "key 'population.crossover_rate' must be between 0 and 1"),
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
    cfg = RunConfig(configs=("1,8,512,64",), iterations=3, dtypes=("bfloat16", "float16"))
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_dtypes_keep_their_order_and_one_dtype_reads_as_a_list(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "dtypes: [bfloat16, float16]\n")).dtypes == (
        "bfloat16", "float16")
    assert load_config(_write(tmp_path, "dtype: float32\n")).dtypes == ("float32",)
    assert load_config(_write(tmp_path, "dtype: null\n")).dtypes is None
    assert load_config(_write(tmp_path, "iterations: 1\n")).dtypes is None
    # a run directory stored before `dtypes` existed still resumes
    old = {**config_to_dict(RunConfig()), "dtype": "bfloat16"}
    del old["dtypes"]
    assert config_from_dict(old).dtypes == ("bfloat16",)


def test_the_default_config_checks_float16_and_bfloat16(repo_root: Path) -> None:
    assert load_config(repo_root / "configs/default.yaml").dtypes == ("float16", "bfloat16")


def test_a_cpu_run_leaves_bfloat16_to_gpu_runs_when_another_dtype_is_listed() -> None:
    from evoattn.settings import run_dtypes
    assert run_dtypes(("float16", "bfloat16"), "cpu") == ("float16",)
    assert run_dtypes(("float16", "bfloat16"), "cuda") == ("float16", "bfloat16")
    assert run_dtypes(("bfloat16",), "cpu") == ("bfloat16",)      # asked for alone: kept
    assert run_dtypes(None, "cpu") is None
