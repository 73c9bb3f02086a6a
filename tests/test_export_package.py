"""The exported package: imports fresh and after pip install, its op compiles with no graph
break, its guard falls back on the CPU, and it serves a real tiny Hugging Face Llama model."""
from __future__ import annotations

import json
import os
import random
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from evoattn.contract.types import ConfigResult, EvalResult, Verdict
from evoattn import settings
from evoattn.config import RunConfig, config_to_dict
from evoattn.export import export_run
from evoattn.export_package import names_for, user_schema
from evoattn.sandbox import SubprocessEvaluator
from evoattn.store import RunStore
from evoattn.types import Program, program_id

ROOT = Path(__file__).resolve().parent.parent
NAIVE = ROOT / "seeds" / "sdpa" / "naive_torch.py"


def _store_run(run_dir: Path, source: str, result: EvalResult, problem: str = "sdpa") -> None:
    cfg = config_to_dict(RunConfig())
    cfg["problem"] = problem
    prog = Program(id=program_id(source), source=source, suffix=".py", parent_id=None,
                   iteration=0, island=0, mutator="seed", change="", result=result)
    with RunStore.open(run_dir, cfg, create=True) as s:
        s.commit_iteration(iteration=0, program=prog, rejection=None, llm_usage=None,
                           rng_state=random.Random(0).getstate(), population_snapshot={})


def _py(code: str, cwd: Path, python: str = sys.executable, env: dict | None = None,
        timeout: int = 600) -> str:
    """Runs Python code in a fresh process; returns its stdout (fails the test on an error)."""
    p = subprocess.run([python, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    return export_naive(tmp_path_factory.mktemp("pkg"))


def bench_env() -> dict[str, str]:
    """The environment a `python -m benchmarks.NAME` process needs outside the repository
    root: the root on its path (the benchmarks are not installed)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}


def export_naive(tmp: Path) -> dict:
    """A run of the naive seed evaluated by the real CPU evaluator, exported."""
    prob = settings.problem("sdpa")
    request = settings.eval_request("sdpa", prob, "cpu", settings.parse_configs(
        prob, "1,2,64,64", "--configs"), None, settings.evaluator_config(trials=1))
    ev = SubprocessEvaluator(request)
    try:
        result = ev.evaluate(NAIVE.read_text(), ".py", "naive_torch.py")
    finally:
        ev.close()
    assert result.verdict is Verdict.PASS, result.reason
    _store_run(tmp / "run", NAIVE.read_text(), result)
    summary = export_run(tmp / "run", tmp / "out")
    return {"out": tmp / "out", "summary": summary, "tmp": tmp}


def test_export_writes_a_package_with_the_kernel_and_its_evidence(exported):
    s, out = exported["summary"], exported["out"]
    pkg = out / s.package
    assert s.package == names_for("sdpa", s.best_id).package and s.has_op
    assert (pkg / "kernel" / "best.py").read_text() == NAIVE.read_text()
    for name in ("__init__.py", "ops.py", "guard.py", "hf.py", "problems.py", "_loader.py",
                 "_runtime.py", "_problems/sdpa.py", "_problems/op.py", "kernel.json",
                 "evidence/best_eval.json", "evidence/lineage.json"):
        assert (pkg / name).is_file(), name
    meta = json.loads((pkg / "kernel.json").read_text())
    assert meta["form"] == "python" and meta["namespace"] == s.namespace
    # verified on the CPU: the op's guard lets nothing through to the kernel
    assert meta["verified"]["device_type"] == "cpu" and meta["verified"]["dtypes"] == ["float16"]
    assert meta["verified"]["head_dims"] == [64] and meta["verified"]["causal"] == [False, True]
    py = (out / "pyproject.toml").read_text()
    assert f'name = "{s.package.replace("_", "-")}"' in py and f'packages = ["{s.package}", "{s.package}._problems"]' in py
    readme = (out / "README.md").read_text()
    for text in (f"from {s.package} import attention", f"torch.ops.{s.namespace}.attention",
                 'hf.register("evoattn")', 'attn_implementation="evoattn"', "fullgraph=True",
                 "### kernel", "### call", "### graph", "class SelfAttention",
                 f"{s.package}.use_kernel(False)",
                 # verified on the CPU: where the kernel runs is said, and that calls fall back
                 "- device: none: every call falls back, on the CPU too (the kernel runs on "
                 "CUDA GPUs only", "verified the kernel in CPU mode (Triton's interpreter"):
        assert text in readme, text
    assert "device: cpu" not in readme


def test_the_package_ships_the_evaluators_runtime_unchanged_and_imports_it(exported):
    s, out = exported["summary"], exported["out"]
    shipped = out / s.package / "_runtime.py"
    assert shipped.read_bytes() == (ROOT / "evoattn" / "contract" / "runtime.py").read_bytes()
    rules = out / s.package / "runtime_rules.py"
    assert rules.read_bytes() == (ROOT / "evoattn" / "contract" / "runtime_rules.py").read_bytes()
    assert not (out / s.package / "_build.py").exists()
    got = _py(f"""
        import json, sys, torch
        import {s.package} as pkg
        from {s.package} import _loader
        pkg.attention(*(torch.randn(1, 2, 8, 64) for _ in range(3)))
        print(json.dumps({{"runtime": _loader._runtime.__file__,
                           "evoattn": sorted(m for m in sys.modules
                                               if m == "evoattn" or m.startswith("evoattn."))}}))
    """, cwd=exported["tmp"], env={"PYTHONPATH": str(out)})
    r = json.loads(got.splitlines()[-1])
    assert Path(r["runtime"]).resolve() == shipped.resolve() and r["evoattn"] == []


def test_the_op_decides_once_per_call_key(exported):
    """A repeated call looks its decision up; new strides, dtype, device or arguments decide
    again, through attention() and through torch.ops alike."""
    s = exported["summary"]
    got = _py(f"""
        import json, torch
        import {s.package} as pkg
        from {s.package} import guard
        checks = []
        real = guard.refusal
        guard.refusal = lambda *a: checks.append(1) or real(*a)
        op = getattr(torch.ops, pkg.NAMESPACE).attention
        x = lambda: torch.randn(1, 2, 16, 64)
        q = x()
        seen = []
        def after(call):
            call()
            seen.append(len(checks))
        after(lambda: pkg.attention(q, q, q))
        after(lambda: pkg.attention(q, q, q))                    # the same call
        after(lambda: pkg.attention(x(), x(), x()))              # other tensors, same key
        after(lambda: op(x(), x(), x()))                         # the op: the same key
        t = torch.randn(1, 16, 2, 64).transpose(1, 2)
        after(lambda: pkg.attention(t, q, q))                    # strides
        after(lambda: pkg.attention(t, q, q))
        after(lambda: pkg.attention(q.half(), q.half(), q.half()))   # dtype
        m = q.to("meta")
        after(lambda: pkg.attention(m, m, m))                    # device
        after(lambda: pkg.attention(m, m, m))
        after(lambda: pkg.attention(q, q, q, causal=True))       # another argument
        after(lambda: op(q, q, q, True))
        after(lambda: pkg.attention(q, q, q, scale=0.5))
        y = torch.randn(1, 2, 32, 64)
        after(lambda: pkg.attention(y, y, y))                    # shape
        g = torch.randn(1, 2, 16, 64, requires_grad=True)
        with torch.no_grad():
            after(lambda: pkg.attention(q, g, q))                # requires_grad
            after(lambda: pkg.attention(q, g, q))
        print(json.dumps({{"seen": seen, "stats": pkg.stats()}}))
    """, cwd=exported["out"])
    r = json.loads(got.splitlines()[-1])
    assert r["seen"] == [1, 1, 1, 1, 2, 2, 3, 4, 4, 5, 5, 6, 7, 8, 8]
    assert r["stats"]["fallback"] == 15 and r["stats"]["kernel"] == 0
    assert r["stats"]["fallback_reasons"] == {
        "verified on cpu only (the kernel runs on CUDA GPUs)": 15}


def test_the_kernel_switch_sends_every_call_to_the_fallback_and_back(exported):
    """With the guard told the CPU may run the kernel, calls count as kernel calls; switched
    off, the same call keys (eager, through torch.ops, in a compiled graph) fall back for that
    reason; switched on again, they reach the kernel again: no decision crossed the switch.
    Each setting keeps its own decisions: switching back and forth decides nothing twice."""
    s = exported["summary"]
    got = _py(f"""
        import json, torch
        import {s.package} as pkg
        from {s.package} import guard, ops
        guard.KERNEL_DEVICE_TYPES = ("cpu",)
        decided, decide = [], ops._decide
        def counted(values, key):
            decided.append(ops.kernel_enabled())
            return decide(values, key)
        ops._decide = counted
        op = getattr(torch.ops, pkg.NAMESPACE).attention
        q, k, v = (torch.randn(1, 2, 24, 64).half() for _ in range(3))
        block = torch.compile(lambda q, k, v: pkg.attention(q, k, v, causal=True) + 1,
                              fullgraph=True)
        def calls():
            pkg.reset_stats()
            pkg.attention(q, k, v, causal=True)
            op(q, k, v, True)
            block(q, k, v)
            return pkg.stats()
        r = {{"on": calls()}}
        pkg.use_kernel(False)
        r["off"], r["off_flag"] = calls(), pkg.kernel_enabled()
        pkg.use_kernel(True)
        r["on_again"] = calls()
        with pkg.kernel_off():
            r["context"] = calls()
        r["after_context"] = calls()
        r["decided"] = decided
        print(json.dumps(r))
    """, cwd=exported["out"])
    r = json.loads(got.splitlines()[-1])
    assert r["decided"] == [True, False], r["decided"]     # one key, decided once per setting
    on = {"kernel": 3, "fallback": 0, "fallback_reasons": {}}
    off = {"kernel": 0, "fallback": 3, "fallback_reasons": {"kernel switched off": 3}}
    assert r["on"] == on and r["on_again"] == on and r["after_context"] == on, r
    assert r["off"] == off and r["context"] == off and r["off_flag"] is False, r


def test_package_imports_in_a_fresh_process_and_registers_the_op(exported):
    s = exported["summary"]
    got = _py(f"""
        import json, torch, torch.nn.functional as F
        import {s.package} as pkg
        q, k, v = (torch.randn(2, 3, 37, 64) for _ in range(3))
        out = torch.ops.{s.namespace}.attention(q, k, v, True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        print(json.dumps({{"op": hasattr(torch.ops.{s.namespace}, "attention"),
                           "err": (out - ref).abs().max().item(), "stats": pkg.stats()}}))
    """, cwd=exported["out"])
    r = json.loads(got.splitlines()[-1])
    assert r["op"] and r["err"] < 1e-6
    assert r["stats"]["kernel"] == 0 and r["stats"]["fallback"] == 1
    assert list(r["stats"]["fallback_reasons"]) == [
        "verified on cpu only (the kernel runs on CUDA GPUs)"]


def test_pip_install_into_a_fresh_venv_then_import_and_call(exported):
    venv = exported["tmp"] / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    # --system-site-packages reaches the base interpreter's packages; when the tests run in a
    # virtualenv, torch (and pip, setuptools) live in this one's: point the new venv at it too.
    purelib = _py("import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=venv,
                  python=python).strip()
    Path(purelib, "parent_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    p = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", str(exported["out"])],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    s = exported["summary"]
    got = _py(f"""
        import torch, torch.nn.functional as F
        import {s.package} as pkg
        print(pkg.__file__)
        q = torch.randn(1, 2, 16, 64).transpose(1, 2).contiguous().transpose(1, 2)
        out = pkg.attention(q, q, q, causal=False)
        print((out - F.scaled_dot_product_attention(q, q, q)).abs().max().item())
        # the op's output is contiguous, as its fake says (attention() falling back returns
        # SDPA's own output, whatever its layout)
        print(hasattr(torch.ops.{s.namespace}, "attention"),
              torch.ops.{s.namespace}.attention(q, q, q).is_contiguous())
    """, cwd=exported["tmp"], python=python)
    where, err, flags = got.strip().splitlines()[-3:]
    assert where.startswith(purelib) and (Path(where).parent / "kernel" / "best.py").is_file()
    assert (Path(where).parent / "_callkey.cpp").is_file()     # what its C++ call path builds
    assert float(err) < 1e-6 and flags == "True True"


def test_compile_fullgraph_runs_the_op_with_no_graph_break(exported):
    s = exported["summary"]
    got = _py(f"""
        import torch, torch.nn.functional as F
        from torch._dynamo.utils import counters
        import {s.package} as pkg

        def block(q, k, v):      # as a transformers layer: (B, S, H, D) views in and out
            o = pkg.attention(q, k, v, causal=True).transpose(1, 2)
            return o.reshape(o.shape[0], o.shape[1], -1).relu() + 1

        q, k, v = (torch.randn(1, 40, 2, 64).transpose(1, 2) for _ in range(3))
        fast = torch.compile(block, fullgraph=True)
        fast(q, k, v)
        pkg.reset_stats()
        for _ in range(3):
            out = fast(q, k, v)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        ref = ref.reshape(1, 40, -1).relu() + 1
        print((out - ref).abs().max().item(), sum(counters["graph_break"].values()),
              pkg.stats()["fallback"])
    """, cwd=exported["out"])
    err, breaks, fallbacks = got.split()[-3:]
    assert float(err) < 1e-5 and breaks == "0" and fallbacks == "3"   # one per call


def test_inputs_that_need_grad_take_differentiable_sdpa(exported):
    s = exported["summary"]
    got = _py(f"""
        import torch
        import {s.package} as pkg
        q = torch.randn(1, 2, 8, 64, requires_grad=True)
        pkg.attention(q, q, q).sum().backward()
        print(q.grad.abs().sum().item() > 0, list(pkg.stats()["fallback_reasons"]))
    """, cwd=exported["out"])
    assert "True ['inputs require grad (the kernel is forward-only)']" in got


def test_tiny_llama_through_the_hf_interface_matches_sdpa(exported):
    s = exported["summary"]
    got = _py(f"""
        import json, torch
        from transformers import LlamaConfig, LlamaForCausalLM
        import {s.package} as pkg
        from {s.package} import hf
        assert hf.register() == "evoattn"
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=97)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
        ids = torch.randint(0, 97, (2, 21))
        pad = torch.ones(2, 21, dtype=torch.long)
        pad[0, :5] = 0
        out = {{}}
        with torch.no_grad():
            for mask in (None, pad):
                model.set_attn_implementation("sdpa")
                ref = model(ids, attention_mask=mask).logits
                model.set_attn_implementation("evoattn")
                pkg.reset_stats()
                got = model(ids, attention_mask=mask).logits
                out["pad" if mask is not None else "plain"] = {{
                    "err": (got - ref).abs().max().item(), "stats": pkg.stats()}}
            model.set_attn_implementation("sdpa")
            ref = model(ids).logits
            model.set_attn_implementation("evoattn")
            fast = torch.compile(model, fullgraph=True)
            from torch._dynamo.utils import counters
            for _ in range(3):           # the count must not become a guard of the graph
                pkg.reset_stats()
                got = fast(ids).logits
            out["compiled"] = {{"err": (got - ref).abs().max().item(), "stats": pkg.stats(),
                               "graphs": counters["stats"]["unique_graphs"]}}
        print(json.dumps(out))
    """, cwd=exported["out"])
    r = json.loads(got.splitlines()[-1])
    assert r["plain"]["err"] < 1e-5 and r["pad"]["err"] < 1e-5
    # two layers, one attention call each: both fell back (CPU), for the reason said
    assert r["plain"]["stats"]["fallback"] == 2 and r["plain"]["stats"]["kernel"] == 0
    assert list(r["plain"]["stats"]["fallback_reasons"]) == [
        "verified on cpu only (the kernel runs on CUDA GPUs)"]
    assert r["pad"]["stats"]["fallback_reasons"] == {"an attention mask (padding or a pattern)": 2}
    # compiled, the causal call still reaches the op (transformers' own SDPA mask builder
    # would materialise the mask under compile), once per layer per call, from one graph
    assert r["compiled"]["err"] < 1e-4 and r["compiled"]["graphs"] == 1
    assert r["compiled"]["stats"]["fallback_reasons"] == {
        "verified on cpu only (the kernel runs on CUDA GPUs)": 2}


def test_model_benchmark_runs_on_cpu_with_a_tiny_config(exported):
    """Rows a, b, c with both gains per dtype and mode, the eager attention share, and the
    CPU's fallback in row c said as a warning."""
    out = exported["tmp"] / "hf_model.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.hf_model", "--export",
                        str(exported["out"]), "--device", "cpu", "--tiny", "--compile",
                        "--dtypes", "float16,bfloat16", "--seqs", "24", "--runs", "2",
                        "--warmup", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=exported["tmp"],
                       env=bench_env())
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["all_agree"] and r["program_id"] == exported["summary"].best_id
    assert r["note"] and not r["all_on_kernel"] and r["dtypes"] == ["float16", "bfloat16"]
    assert [row["dtype"] for row in r["rows"]] == ["float16", "bfloat16"]
    for row in r["rows"]:
        assert row["seq"] == 24 and row["layers"] == 2 and row["hidden"] == 64
        assert (row["heads"], row["kv_heads"], row["head_dim"]) == (4, 2, 16)
        for mode in ("eager", "compile"):
            got = row[mode]
            a, b, c = (got[x]["ms"] for x in "abc")
            assert min(a, b, c) > 0 and len(got["c"]["runs_ms"]) == 2
            assert got["kernel_gain"] == pytest.approx(b / c)
            assert got["integration_gain"] == pytest.approx(a / b)
            assert got["a"]["calls"]["kernel"] == got["a"]["calls"]["fallback"] == 0
            assert got["b"]["calls"]["fallback_reasons"] == {"kernel switched off": 2}
            assert got["c"]["calls"]["kernel"] == 0 and got["c"]["calls"]["fallback"] == 2
            assert got["c"]["max_abs"] <= 2 * got["a"]["max_abs"]
        for x in "abc":
            share = row["eager"][x]
            assert 0 < share["attention_ms"] < share["forward_ms"]
            assert share["attention_share"] == pytest.approx(
                share["attention_ms"] / share["forward_ms"])
            assert "attention_share" not in row["compile"][x]
    assert "| 64 | 16 | 4/2 | float16 | 24 | eager |" in p.stdout
    assert "| 64 | 16 | 4/2 | bfloat16 | 24 | compile |" in p.stdout
    assert "WARNING: hidden 64 float16 S=24 eager: row c ran the kernel in 0" in p.stderr


def test_model_benchmark_row_c_runs_the_kernel_and_row_b_does_not(exported):
    """With the guard told the CPU may run the kernel (verified in float16 at head dim 64), row
    c's calls reach it, row b's fall back as switched off, and bfloat16 falls back, said."""
    from benchmarks import hf_model as bench
    pkg = bench.load_export(str(exported["out"]))
    guard = sys.modules[f"{pkg.__name__}.guard"]
    guard.KERNEL_DEVICE_TYPES = ("cpu",)
    try:
        r = bench.main(["--export", str(exported["out"]), "--device", "cpu", "--tiny",
                        "--hidden", "256", "--layers", "3", "--dtypes", "float16,bfloat16",
                        "--seqs", "24", "--runs", "1", "--warmup", "0"])
    finally:
        guard.KERNEL_DEVICE_TYPES = ("cuda",)
    f16, bf16 = (row["eager"] for row in r["rows"])
    assert r["rows"][0]["head_dim"] == 64 and r["rows"][0]["layers"] == 3
    assert f16["c"]["calls"] == {"kernel": 3, "fallback": 0, "fallback_reasons": {}}
    assert f16["b"]["calls"] == {"kernel": 0, "fallback": 3,
                                 "fallback_reasons": {"kernel switched off": 3}}
    assert f16["c"]["max_abs"] <= 2 * f16["a"]["max_abs"] and pkg.kernel_enabled()
    assert bf16["c"]["calls"]["fallback_reasons"] == {
        "dtype bfloat16 (verified: float16, all inputs alike)": 3}
    assert not r["all_on_kernel"] and "compile" not in r["rows"][0]


def test_model_benchmark_times_its_rows_in_interleaved_rounds(monkeypatch):
    """Rows a, b and c are each checked and warmed up, then timed one forward each per round,
    the order reversed every round, each forward run as its own row (implementation and kernel
    switch): a drift over the run falls on every row alike. The check takes every position's
    logits, the timed forwards the last position's (as generate's prefill); the do_bench
    cross-check times rows b and c taking turns, its gain the median of its rounds' ratios."""
    import argparse
    import torch
    from benchmarks import hf_model as bench
    state, timed = {}, []

    class Pkg:
        def use_kernel(self, on):
            state["kernel"] = on

        def reset_stats(self):
            pass

        def stats(self):
            return {}

    class Model:
        def set_attn_implementation(self, name):
            state["impl"] = name

        def __call__(self, ids, use_cache, logits_to_keep=0):
            kept.append(logits_to_keep)
            return argparse.Namespace(logits=torch.zeros(1, 2, 3))

    class Clock:
        def ms(self, fn):
            kept.clear()
            fn()
            assert kept == [1]
            timed.append((state["impl"], state["kernel"]))
            return float(len(timed))

    benched = []

    def do_bench(fn, warmup, rep, return_mode):
        kept.clear()
        fn()
        assert kept == [1] and return_mode == "median"
        benched.append(state["kernel"])
        return {False: [2.0, 4.0, 3.0], True: [1.0, 1.0, 2.0]}[state["kernel"]][
            sum(b == state["kernel"] for b in benched) - 1]

    import triton.testing
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    kept: list = []
    a = argparse.Namespace(runs=3, warmup=1, cache=True, cross_check=3)
    got = bench.measure_rows(Pkg(), Model(), None, torch.zeros(1, 2, 3), Clock(), a,
                             share=False, say_row=lambda _: None)
    assert benched == [False, True, True, False, False, True]       # b c, c b, b c
    # rounds' ratios b/c: 2/1, 4/1, 3/2
    assert got["do_bench"]["kernel_gain"] == 2.0
    assert got["do_bench"]["kernel_gain_range"] == [1.5, 4.0]
    row = {label: (impl, kernel) for label, impl, kernel in bench.ROWS}
    order = [row[x] for x in "abc"]
    assert timed == order + order[::-1] + order
    assert [got[x]["runs_ms"] for x in "abc"] == [[1.0, 6.0, 7.0], [2.0, 5.0, 8.0],
                                                  [3.0, 4.0, 9.0]]
    assert got["b"]["ms"] == 5.0 and not got["b"]["kernel_on"] and got["c"]["kernel_on"]


# ---- user problems: the op's schema from the entry signature --------------------------
def test_user_schema_reads_the_entry_signature():
    src = ("import torch\n"
           "def attention(q, k, v: torch.Tensor, softcap=50.0, scale=None, causal: bool = False,\n"
           "              bias: torch.Tensor | None = None, n: int = -3, w: int = 0):\n"
           "    pass\n")
    assert user_schema(src, "attention") == (
        "(Tensor q, Tensor k, Tensor v, float softcap=50.0, float? scale=None, "
        "bool causal=False, Tensor? bias=None, int n=-3, int w=0) -> Tensor")
    assert user_schema("def attention(q, *rest): pass\n", "attention") is None
    assert user_schema("def attention(q, mode='a'): pass\n", "attention") is None
    assert user_schema("def other(q): pass\n", "attention") is None


def test_user_problem_export_registers_its_own_schema(tmp_path):
    problem = ROOT / "examples" / "softcap" / "problem.py"
    seed = (ROOT / "examples" / "softcap" / "seed.py").read_text()
    res = EvalResult(verdict=Verdict.PASS, reason="", fitness=1.0, problem="softcap",
                     configs=(ConfigResult(params={"B": 1, "H": 2, "S": 64, "D": 64},
                                           dtype="float16", verdict=Verdict.PASS),),
                     device="NVIDIA H100", timing_device="cuda",
                     device_info={"capability": "9.0"})
    _store_run(tmp_path / "run", seed, res, problem=str(problem))
    s = export_run(tmp_path / "run", tmp_path / "out")
    assert s.package.startswith("evoattn_softcap_") and s.has_op
    got = _py(f"""
        import torch
        import {s.package} as pkg
        print(torch.ops.{s.namespace}.attention.default._schema)
        try:
            pkg.attention(*(torch.randn(1, 2, 8, 64) for _ in range(3)), softcap=30.0)
        except NotImplementedError as e:
            print("refused:", e)
    """, cwd=tmp_path / "out")
    assert "float softcap=50." in got and "float? scale=None" in got
    assert "refused:" in got and "cpu tensors" in got and "no PyTorch fallback" in got


def test_a_multi_file_kernel_loads_with_its_companions(tmp_path):
    main = textwrap.dedent("""\
        # evoattn: companion helper.py
        # evoattn: companion fast.cu when(@target=sm90) when(USE_FAST=True)
        import importlib.util, pathlib
        USE_FAST = True  # evoattn: choice(True, False)
        _spec = importlib.util.spec_from_file_location(
            "helper", pathlib.Path(__file__).parent / "helper.py")
        helper = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(helper)
        LIBS = dict(EVOATTN_LIBRARIES)

        def attention(q, k, v, causal=False, scale=None):
            return helper.scaled(q)
        """)
    from evoattn.contract import program
    source = program.join([("hybrid.py", main), ("helper.py", "def scaled(x):\n    return 2 * x\n"),
                           ("fast.cu", 'extern "C" int f() { return 0; }\n')])
    res = EvalResult(verdict=Verdict.PASS, reason="", fitness=1.0, device="cpu",
                     timing_device="cpu",
                     configs=(ConfigResult(params={"B": 1, "H": 1, "S": 8, "D": 64,
                                                   "causal": False},
                                           dtype="float16", verdict=Verdict.PASS),))
    _store_run(tmp_path / "run", source, res)
    s = export_run(tmp_path / "run", tmp_path / "out")
    got = _py(f"""
        import torch
        import {s.package} as pkg
        from {s.package} import _runtime, ops
        mod = pkg.load_kernel_module()
        print(mod.LIBS, mod.attention(torch.ones(1), None, None).item())
        comps = [(c["name"], c["when"]) for c in ops.META["companions"]]
        print([_runtime.cuda_companions(comps, {{"USE_FAST": value}}, {{"target": target}})
               for value, target in (("True", "sm90"), ("True", "sm80"), ("False", "sm90"))])
    """, cwd=tmp_path / "out")
    libs, built = got.strip().splitlines()[-2:]
    assert libs == "{} 2.0" and built == "[['fast.cu'], [], []]"


def test_the_export_serves_every_dtype_a_correct_result_was_checked_in() -> None:
    from evoattn.export_package import verified_set
    cfg = ConfigResult(params={"B": 1, "H": 2, "S": 64, "D": 64, "causal": True},
                       dtype="float16", verdict=Verdict.PASS)
    both = EvalResult(Verdict.PASS, "", 1.0, (cfg,), dtypes=("float16", "bfloat16"))
    assert verified_set(both)["dtypes"] == ["bfloat16", "float16"]
    assert verified_set(EvalResult(Verdict.PASS, "", 1.0, (cfg,)))["dtypes"] == ["float16"]
    wrong = EvalResult(Verdict.INCORRECT, "bfloat16: ...", 0.0, (cfg,),
                       dtypes=("float16", "bfloat16"))
    assert verified_set(wrong)["dtypes"] == ["float16"]


def test_model_benchmark_judges_agreement_against_sdpa_with_a_slack_for_near_ties():
    """A row agrees when its logits are as close to the float32 reference as SDPA's: a few
    near ties flipped the other way pass, a real loss of accuracy does not."""
    from benchmarks import hf_model as bench
    sdpa = {"max_abs": 0.02, "top1": 0.995}
    assert bench.judge(sdpa, {"max_abs": 0.03, "top1": 0.99})       # 5 in 1000 ties flipped
    assert not bench.judge(sdpa, {"max_abs": 0.03, "top1": 0.97})   # accuracy lost
    assert not bench.judge(sdpa, {"max_abs": 0.05, "top1": 1.0})    # logits 2.5x further off


def test_attention_time_leaves_transformers_attention_interface_as_it_found_it(monkeypatch):
    """hf_model.attention_time wraps an implementation's entry for one forward; after it, a
    later registration of that name must be what transformers calls (an override left in the
    interface's local mapping would shadow it: a leak from one test, or package, to the next)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from benchmarks import hf_model as bench
    first, second = (lambda *a, **k: "first"), (lambda *a, **k: "second")
    monkeypatch.setitem(AttentionInterface._global_mapping, "timed_impl", first)

    class Clock:
        def ms(self, fn):
            fn()
            return 1.0

        def mark(self):
            return 0.0

        def between(self, s, e):
            return 0.0

    seen = []
    bench.attention_time(lambda: seen.append(ALL_ATTENTION_FUNCTIONS["timed_impl"]()),
                         "timed_impl", Clock())
    assert seen == ["first"]
    AttentionInterface.register("timed_impl", second)
    assert ALL_ATTENTION_FUNCTIONS["timed_impl"]() == "second"
    assert "timed_impl" not in ALL_ATTENTION_FUNCTIONS._local_mapping


def test_the_op_runs_what_the_kernels_prepare_returned_from_a_keys_second_call(tmp_path):
    """attention() calls the kernel module's prepare() once per call key, after the key's
    first call, and runs what it returned for the key's later calls (counted as kernel calls);
    None, a raise, or inputs the kernel gets as copies keep the entry."""
    main = textwrap.dedent("""\
        import torch
        LOG = []
        NONE_FOR_CAUSAL = False

        def attention(q, k, v, causal=False, scale=None):
            LOG.append(("entry", causal))
            return q + 1

        def prepare(q, k, v, causal=False, scale=None):
            LOG.append(("prepare", causal, tuple(q.shape)))
            if scale == 0.5:
                raise ValueError("no")
            if causal and NONE_FOR_CAUSAL:
                return None
            def prepared(q, k, v, causal=False, scale=None):
                LOG.append(("prepared", causal))
                return q + 1
            return prepared
        """)
    cfgs = tuple(ConfigResult(params={"B": 1, "H": 2, "S": 8, "D": 64, "causal": c},
                              dtype="float16", verdict=Verdict.PASS) for c in (False, True))
    res = EvalResult(verdict=Verdict.PASS, reason="", fitness=1.0, device="cpu",
                     timing_device="cpu", configs=cfgs)
    _store_run(tmp_path / "run", main, res)
    s = export_run(tmp_path / "run", tmp_path / "out")
    got = _py(f"""
        import json, torch
        import {s.package} as pkg
        from {s.package} import guard
        guard.KERNEL_DEVICE_TYPES = ("cpu",)
        mod = pkg.load_kernel_module()
        x = lambda: torch.randn(1, 2, 8, 64).half()
        logs = []
        def calls(n, **kw):
            mod.LOG.clear()
            outs = [pkg.attention(q, q, q, **kw) for q in (x() for _ in range(n))]
            logs.append(list(mod.LOG))
        calls(3)                                   # one key: entry, prepare, then prepared
        calls(2)                                   # the same key later: prepared only
        mod.NONE_FOR_CAUSAL = True
        calls(3, causal=True)                      # prepare gave None: the entry
        calls(2, scale=0.5)                        # prepare raised: the entry
        t = torch.randn(1, 8, 2, 64).half().transpose(1, 2)
        mod.LOG.clear(); pkg.attention(t, t, t); pkg.attention(t, t, t)   # copies: no prepare
        logs.append(list(mod.LOG))
        q = x()
        right = bool((pkg.attention(q, q, q) == q + 1).all())
        print(json.dumps({{"logs": logs, "stats": pkg.stats(), "right": right}}))
    """, cwd=tmp_path / "out")
    r = json.loads(got.splitlines()[-1])
    shape = [1, 2, 8, 64]
    assert r["logs"][0] == [["entry", False], ["prepare", False, shape], ["prepared", False],
                            ["prepared", False]]
    assert r["logs"][1] == [["prepared", False]] * 2
    assert r["logs"][2] == [["entry", True], ["prepare", True, shape], ["entry", True],
                            ["entry", True]]
    assert r["logs"][3] == [["entry", False], ["prepare", False, shape], ["entry", False]]
    assert r["logs"][4] == [["entry", False], ["entry", False]]
    assert r["stats"]["kernel"] == 13 and r["stats"]["fallback"] == 0 and r["right"]
