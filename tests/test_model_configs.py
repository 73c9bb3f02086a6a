"""`evoattn run --model`: a Hugging Face config's attention read and turned into model configs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from evoattn import model_configs as mc
from evoattn.errors import UsageError
from rundb import query

ROOT = Path(__file__).resolve().parent.parent
EXIT_USAGE = 4

# The attention fields of the published Gemma-2-2B and GPT-OSS-20B config.json files.
GEMMA2_2B = {"model_type": "gemma2", "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 256, "hidden_size": 2304, "num_hidden_layers": 26,
             "sliding_window": 4096, "attn_logit_softcapping": 50.0,
             "query_pre_attn_scalar": 256, "max_position_embeddings": 8192}
GPT_OSS_20B = {"model_type": "gpt_oss", "num_attention_heads": 64, "num_key_value_heads": 8,
               "head_dim": 64, "hidden_size": 2880, "num_hidden_layers": 24,
               "sliding_window": 128, "max_position_embeddings": 131072,
               "layer_types": ["sliding_attention", "full_attention"] * 12}


def _cfg(B: int, H: int, Hkv: int, S: int, D: int, window: int, softcap: float,
         sinks: bool) -> dict:
    return {"B": B, "H": H, "Hkv": Hkv, "S": S, "D": D, "window": window, "softcap": softcap,
            "sinks": sinks}


def _write(tmp: Path, data: dict, name: str = "config.json") -> Path:
    p = tmp / name
    p.write_text(json.dumps(data))
    return p


def _evoattn(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "evoattn.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_gemma2_config_json_gives_global_configs_and_a_window_config_past_the_window(
        tmp_path: Path) -> None:
    ma = mc.read(str(_write(tmp_path, GEMMA2_2B)))
    assert (ma.window, ma.windowed_layers, ma.layers, ma.softcap) == (4096, 13, 26, 50.0)
    # the window equals the sequence up to 4096 tokens: those layers are global ones there
    assert mc.derive_configs(ma) == [
        _cfg(16, 8, 4, 1024, 256, 0, 50.0, False), _cfg(8, 8, 4, 2048, 256, 0, 50.0, False),
        _cfg(4, 8, 4, 4096, 256, 0, 50.0, False), _cfg(2, 8, 4, 8192, 256, 0, 50.0, False),
        _cfg(2, 8, 4, 8192, 256, 4096, 50.0, False)]


def test_gpt_oss_config_json_gives_sinks_on_both_layer_kinds_within_eager_memory(
        tmp_path: Path) -> None:
    ma = mc.read(str(_write(tmp_path, GPT_OSS_20B)))
    assert ma.sinks and ma.windowed_layers == 12
    # 64 heads: at 8k one sequence's eager scores take 8 GiB, at 16k 32 GiB (left out)
    assert mc.derive_configs(ma) == [
        _cfg(b, 64, 8, s, 64, w, 0.0, True)
        for b, s in ((16, 1024), (8, 2048), (4, 4096), (1, 8192)) for w in (0, 128)]


def test_query_pre_attn_scalar_sets_the_scale_only_where_it_differs_from_the_default(
        tmp_path: Path) -> None:
    ma = mc.read(str(_write(tmp_path, {**GEMMA2_2B, "head_dim": 128,
                                       "query_pre_attn_scalar": 144})))
    assert all(c["scale"] == pytest.approx(144 ** -0.5) for c in mc.derive_configs(ma))


def test_model_types_read_transformers_default_configs() -> None:
    gemma = mc.read("gemma2")
    assert (gemma.heads, gemma.kv_heads, gemma.head_dim, gemma.softcap) == (8, 4, 256, 50.0)
    assert gemma.windowed_layers == gemma.layers // 2          # alternate layers
    mistral = mc.read("mistral")
    assert mistral.windowed_layers == mistral.layers and mistral.window == 4096
    assert [(c["B"], c["S"], c["window"]) for c in mc.derive_configs(mistral)] == [
        (16, 1024, 0), (8, 2048, 0), (4, 4096, 0), (2, 8192, 4096)]    # 32 heads: 16k is 16 GiB
    llama = mc.read("llama")                                    # max positions 2048
    assert mc.derive_configs(llama) == [_cfg(16, 32, 32, 1024, 128, 0, 0.0, False),
                                        _cfg(8, 32, 32, 2048, 128, 0, 0.0, False)]


def test_cpu_configs_keep_one_config_per_layer_kind_at_the_cpu_length() -> None:
    assert mc.cpu_configs(mc.read("gemma2"), 64) == [_cfg(1, 8, 4, 64, 256, 0, 50.0, False),
                                                      _cfg(1, 8, 4, 64, 256, 16, 50.0, False)]


def test_another_problems_run_config_gets_the_model_problem_and_seed(tmp_path: Path) -> None:
    from evoattn.runner import plan_run
    run_cfg = tmp_path / "sdpa.yaml"
    run_cfg.write_text(yaml.safe_dump({"problem": "sdpa", "seed": str(
        ROOT / "seeds" / "sdpa" / "flash_triton.py"), "configs": ["1,2,64,64,nc"],
        "output": str(tmp_path / "run")}))
    over, _ = mc.run_overrides("gpt_oss", str(run_cfg), "cpu")
    plan = plan_run(str(run_cfg), None, None, None, "cpu", None, None, over)
    assert plan.problem_ref == "model"
    assert plan.seed_path == ROOT / "seeds" / "model" / "model_triton.py"
    # one config per layer kind at the CPU length; the file's sdpa configs are replaced
    assert plan.configs == (_cfg(1, 64, 8, 64, 64, 0, 0.0, True),
                            _cfg(1, 64, 8, 64, 64, 16, 0.0, True))


@pytest.mark.parametrize("data,key", [
    ({"model_type": "llama", "num_attention_heads": 0}, "num_attention_heads"),
    ({"hidden_size": 64}, "num_attention_heads"),
    ({**GEMMA2_2B, "head_dim": 80}, "head_dim"),
    ({**GEMMA2_2B, "num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_a_config_without_usable_heads_names_the_key(tmp_path: Path, data: dict,
                                                      key: str) -> None:
    with pytest.raises(UsageError, match=f"config.json: key '{key}'"):
        mc.read(str(_write(tmp_path, data)))


@pytest.mark.parametrize("args,says", [
    (("no_such_type",), "unknown model type 'no_such_type'"),
    (("missing/config.json",), "missing/config.json: model config file not found"),
    (("gemma2", "--resume", "runs/x"), "it takes no --model"),
])
def test_bad_model_is_one_line_and_the_usage_exit_code(args: tuple, says: str) -> None:
    p = _evoattn("run", "--model", *args, "--iterations", "0", timeout=300)
    assert p.returncode == EXIT_USAGE, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("UsageError: ") and says in lines[0], lines


def test_a_tiny_gemma2_config_runs_on_the_cpu_at_the_problem_cpu_length(tmp_path: Path) -> None:
    tiny = _write(tmp_path, {"model_type": "gemma2", "num_attention_heads": 2,
                             "num_key_value_heads": 1, "head_dim": 64, "hidden_size": 64,
                             "num_hidden_layers": 2, "sliding_window": 32,
                             "query_pre_attn_scalar": 64, "max_position_embeddings": 128},
                  "tiny_config.json")
    run_cfg = tmp_path / "run.yaml"       # the model problem and seed, one trial per config
    run_cfg.write_text(yaml.safe_dump({
        "problem": "model", "seed": str(ROOT / mc.PHASES["prefill"].seed), "dtypes": ["float16"],
        "output": str(tmp_path / "run"), "evaluator": {"trials": 1, "run_timeout_s": 600}}))
    p = _evoattn("run", "--model", str(tiny), "--config", str(run_cfg), "--iterations", "1",
                 "--device", "cpu", "--quiet")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    said = " ".join(p.stdout.split())
    assert "each layer kind at S=64, B=1" in said, said[:2000]
    assert "1 global, 1 windowed (32)" in said
    rows = query(tmp_path / "run" / "run.sqlite", "SELECT verdict FROM programs")
    assert rows and rows[0][0] == "pass", rows


def test_the_default_gemma2_and_gpt_oss_give_the_model_problems_own_configs() -> None:
    from evoattn.problems.model_prefill import GEMMA2_2B as GEMMA, GPT_OSS_20B as GPT_OSS
    assert mc.derive_configs(mc.read("gemma2")) == list(GEMMA)
    assert mc.derive_configs(mc.read("gpt_oss")) == list(GPT_OSS)


def test_decode_phase_gives_each_step_at_each_layer_kind_the_window_shortens(
        tmp_path: Path) -> None:
    ma = mc.read(str(_write(tmp_path, GEMMA2_2B)))      # max positions 8192: no 16k contexts
    got = mc.derive_configs(ma, "decode")
    assert [(c["B"], c["T"], c["ctx"], c["window"], c["lens"]) for c in got] == [
        (8, 1, 4096, 0, "ragged"), (16, 1, 8192, 0, "ragged"), (16, 1, 8192, 4096, "ragged"),
        (4, 4, 8192, 0, "ragged"), (4, 4, 8192, 4096, "ragged")]
    assert all(c["H"] == 8 and c["Hkv"] == 4 and c["D"] == 256 and c["softcap"] == 50.0
               and not c["sinks"] and "S" not in c for c in got)
    assert "scale" not in got[0]            # query_pre_attn_scalar 256: the default 1/sqrt(D)
    from evoattn.problems import get_problem
    problem = get_problem("model_decode")                # the problem takes them as written
    assert len(problem.parse_configs(";".join(mc.config_spec(c) for c in got))) == len(got)


def test_run_model_decode_sets_the_decode_problem_seed_and_cpu_configs(tmp_path: Path) -> None:
    gpt = _write(tmp_path, GPT_OSS_20B)
    over, _ = mc.run_overrides(str(gpt), mc.MODEL_RUN_CONFIG["prefill"], "cpu", "decode")
    assert over["problem"] == "model_decode"
    assert over["seed"].endswith("seeds/model/model_decode_triton.py")
    specs = [dict(kv.split("=") for kv in c.split(",")) for c in over["configs"]]
    assert [(s["B"], s["T"], s["window"], s["sinks"]) for s in specs] == [
        ("1", "1", "0", "True"), ("1", "1", str(max(1, int(specs[0]["ctx"]) // 4)), "True")]
