"""`evoattn bench-model`: an exported package in a tiny model on the CPU, every row measured."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evoattn import bench_model as bm
from test_export_package import export_naive

ROOT = Path(__file__).resolve().parent.parent
EXIT_USAGE = 4
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 97, "max_position_embeddings": 256}


def _evoattn(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "evoattn.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bench")
    pkg = export_naive(tmp)
    config = tmp / "tiny_llama.json"
    config.write_text(json.dumps(TINY_LLAMA))
    out = tmp / "bench.json"
    p = _evoattn("bench-model", str(pkg["out"]), "--model", str(config), "--device", "cpu",
                 "--shape", "2,32", "--generate", "2,16,3", "--impl", "eager", "--impl",
                 "sdpa", "--rounds", "2", "--json", str(out))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return {"stdout": p.stdout, "json": json.loads(out.read_text())}


def test_every_row_of_each_workload_is_printed_and_written_with_s_r_and_the_prediction(
        bench: dict) -> None:
    data = bench["json"]
    workloads = ["prefill B=2 S=32", "generate B=2 P=16 N=3"]
    assert [(r["workload"], r["name"]) for r in data["rows"]] == [
        (w, n) for w in workloads for n in ("eager", "sdpa", "evoattn", bm.NULL)]
    for r in data["rows"]:
        assert r["time_ms"] > 0 and r["tokens_per_s"] > 0
        figures = (r["share"], r["op_speedup"], r["predicted"], r["gain"], r["op_time_ms"])
        if r["name"] == bm.NULL:
            assert figures == (None,) * 5 and r["kept"] is None
        else:
            assert all(isinstance(v, float) for v in figures), r
            base = next(x for x in data["rows"] if x["workload"] == r["workload"]
                        and x["name"] == data["base"][r["workload"]])
            assert r["gain"] == pytest.approx(base["time_ms"] / r["time_ms"])
    assert set(data["base"].values()) <= {"eager", "sdpa"}
    said = " ".join(bench["stdout"].split())
    for text in ("prefill B=2 S=32", "generate B=2 P=16 N=3", "evoattn_null", "predicted",
                 "CPU: a tiny model in float32"):
        assert text in said


def test_the_package_row_counts_its_calls_and_says_why_they_fell_back_on_the_cpu(
        bench: dict) -> None:
    pkg = [r for r in bench["json"]["rows"] if r["name"] == "evoattn"]
    prefill = pkg[0]["stats"]
    # two layers, one call each: the CPU guard sends both elsewhere
    assert prefill == {"kernel": 0, "fallback": 2, "fallback_reasons": {
        "verified on cpu only (the kernel runs on CUDA GPUs)": 2}}
    assert pkg[1]["stats"]["fallback"] == 2 * 3             # a prompt and two cached steps
    assert all(r["stats"] is None for r in bench["json"]["rows"] if r["name"] != "evoattn")


def test_accuracy_rows_agree_with_float32_on_a_float32_cpu_model(bench: dict) -> None:
    acc = {a["name"]: a for a in bench["json"]["accuracy"]}
    assert list(acc) == ["eager", "sdpa", "evoattn"]
    assert acc["eager"]["max_abs_logit_err"] == 0.0          # the reference itself
    assert all(a["top1_agreement"] == 1.0 and a["max_abs_logit_err"] < 1e-4
               for a in acc.values())


def test_null_attention_reads_no_value_and_returns_zeros_of_the_output_shape() -> None:
    q = torch.full((2, 4, 5, 16), float("nan"))               # (B, H, S, D)
    k = v = torch.full((2, 2, 5, 16), float("nan"))
    out, weights = bm.null_attention(None, q, k, v, None, scaling=0.25)
    assert out.shape == (2, 5, 4, 16) and weights is None     # (B, S, H, D)
    assert torch.equal(out, torch.zeros_like(out))


def test_an_implementation_that_raises_in_the_model_is_a_row_with_its_error(
        tmp_path: Path) -> None:
    from transformers import AttentionInterface

    class Pkg:                       # the package's counters, as an exported one has them
        def reset_stats(self) -> None: ...
        def stats(self) -> dict: return {"kernel": 0, "fallback": 0, "fallback_reasons": {}}

    def raising(module, query, key, value, attention_mask, **kwargs):
        raise ValueError("sinks are not supported\nsecond line")

    AttentionInterface.register("raises", raising)
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_LLAMA))
    model = bm.build_model(str(config), "cpu", layers=1)
    result = bm.measure(model, Pkg(), "raises", str(config), "cpu", bm.Settings(
        shapes=((1, 8),), gen=(1, 4, 0), rounds=1, impls=("eager",)))
    rows = {r.name: r for r in result.rows}
    assert list(rows) == ["eager", bm.NULL, "raises"]
    assert rows["raises"].error == "ValueError: sinks are not supported"
    assert rows["raises"].time_ms is None and rows["eager"].time_ms > 0
    assert [(a.name, a.top1_agreement) for a in result.accuracy] == [("eager", 1.0),
                                                                      ("raises", None)]


def test_amdahl_prediction_comes_from_the_share_and_the_op_speedup() -> None:
    # null 1 s; base 3 s of which 2 s attention calls; the package's calls take 1 s
    got = {"sdpa": (3.0, 2.0, None), "evoattn": (2.5, 1.0, {"kernel": 2}), bm.NULL: (1.0, None,
                                                                                  None)}
    rows = {r.name: r for r in bm._rows("prefill", got, "sdpa", "evoattn", 100)}
    pkg = rows["evoattn"]
    assert pkg.share == pytest.approx(0.6) and pkg.op_speedup == pytest.approx(2.0)
    # s_base = 2/3, r = 2: 1 / (1/3 + 1/3) = 1.5 predicted; measured 3/2.5 = 1.2
    assert pkg.predicted == pytest.approx(1.5) and pkg.gain == pytest.approx(1.2)
    assert pkg.kept == pytest.approx(0.4)                     # 0.2 of the 0.5 predicted
    assert rows["sdpa"].gain == pytest.approx(1.0) and rows["sdpa"].predicted == pytest.approx(1)


@pytest.mark.parametrize("args,says", [
    (("--shape", "2x32"), "--shape 2x32: expected 2 comma-separated integers"),
    (("--shape", "2,32", "--generate", "1,2"), "--generate 1,2: expected 3 comma-separated"),
])
def test_bad_bench_input_is_one_usage_line(tmp_path: Path, args: tuple, says: str) -> None:
    p = _evoattn("bench-model", str(tmp_path), "--model", "llama", "--device", "cpu", *args,
                 timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == EXIT_USAGE and len(lines) == 1 and says in lines[0], p.stderr


def test_a_directory_without_a_package_is_a_usage_error(tmp_path: Path) -> None:
    p = _evoattn("bench-model", str(tmp_path), "--model", "llama", "--device", "cpu",
                 timeout=300)
    assert p.returncode == EXIT_USAGE
    assert p.stderr.strip() == f"UsageError: {tmp_path}: no exported package here (no hf.py " \
                               "in it or below it)"
