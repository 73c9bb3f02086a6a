"""export_run: files, best source, lineage, leaderboard, README, atomic out dir."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from evoattn.contract import program
from evoattn.contract.types import ConfigResult, EvalResult, Times, Verdict
from evoattn import export as export_mod
from evoattn.config import RunConfig, config_to_dict
from evoattn.errors import RunDirError
from evoattn.export import export_run
from evoattn.store import RunStore
from evoattn.types import Program

PARAMS = {"B": 1, "H": 2, "S": 128, "D": 64, "causal": False}


def result(fitness: float, verdict: Verdict = Verdict.PASS) -> EvalResult:
    cfgs = (ConfigResult(params=PARAMS, dtype="float16", verdict=verdict, ms=1.0,
                         baseline_ms=fitness * 0.9, speedup=fitness * 0.9),
            ConfigResult(params={**PARAMS, "causal": True}, dtype="float16", verdict=verdict,
                         ms=1.0, baseline_ms=fitness * 1.1, speedup=fitness * 1.1))
    return EvalResult(verdict=verdict, reason="", fitness=fitness if verdict.is_pass else 0.0,
                      configs=cfgs, device="NVIDIA H100", timing_device="cuda")


def make(pid: str, parent: str | None, fitness: float, iteration: int,
         verdict: Verdict = Verdict.PASS, suffix: str = ".py", source: str | None = None,
         change: str = "") -> Program:
    return Program(id=pid, source=source or f"def attention(q, k, v, causal, scale):  # {pid}\n",
                   suffix=suffix, parent_id=parent, iteration=iteration, island=0,
                   mutator="seed" if parent is None else "llm:m", change=change or f"did {pid}",
                   result=result(fitness, verdict))


def build_run(run_dir, programs: list[Program]) -> None:
    with RunStore.open(run_dir, config_to_dict(RunConfig()), create=True) as s:
        for i, p in enumerate(programs):
            s.commit_iteration(iteration=i, program=p, rejection=None, llm_usage=None,
                               rng_state=random.Random(i).getstate(), population_snapshot={})


def _stored_fitness(p: Program, fitness: float) -> Program:
    """An incorrect program whose stored fitness is high: only its verdict keeps it out."""
    return dataclasses.replace(p, result=dataclasses.replace(p.result, fitness=fitness))


@pytest.fixture
def run(tmp_path):
    progs = [make("seed", None, 1.0, 0),
             make("a1", "seed", 1.2, 1, change="--- a\n+++ b\n@@ -1 +1 @@\n-BLOCK_M=64\n+BLOCK_M=128"),
             _stored_fitness(make("zz", "seed", 50.0, 2, verdict=Verdict.INCORRECT), 50.0),
             make("a2", "a1", 1.5, 3),
             make("best", "a2", 2.0, 4, source="def attention(q, k, v, causal, scale):\n"
                                               "    return 'the best'\n")]
    progs += [make(f"f{i:02d}", "seed", 1.0 + i / 100, 5 + i) for i in range(12)]
    run_dir = tmp_path / "run"
    build_run(run_dir, progs)
    return run_dir


def test_export_writes_every_file_with_the_best_source(run, tmp_path):
    out = tmp_path / "out"
    summary = export_run(run, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["best.py", "best_eval.json", "lineage.md", "lineage.json", "leaderboard.md",
         "leaderboard.json", "README.md", "pyproject.toml", "export.json", "evoattn_sdpa_best"])
    assert summary.best_id == "best" and summary.best_fitness == 2.0
    assert summary.package == "evoattn_sdpa_best" and summary.namespace == "evoattn_best"
    assert summary.best_source.read_text() == "def attention(q, k, v, causal, scale):\n" \
                                              "    return 'the best'\n"
    assert (summary.package_dir / "kernel" / "best.py").read_text() == \
        summary.best_source.read_text()
    ev = json.loads(summary.best_eval.read_text())
    assert ev["verdict"] == "pass" and ev["fitness"] == 2.0 and len(ev["configs"]) == 2
    assert json.loads((summary.package_dir / "evidence" / "best_eval.json").read_text()) == ev
    readme = summary.readme.read_text()
    assert "from evoattn_sdpa_best import attention" in readme and "evoattn eval best.py" in readme
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["package"] == "evoattn_sdpa_best" and "evoattn_sdpa_best" in manifest["files"]


def test_readme_has_timings_per_config_in_every_mode(tmp_path):
    times = Times(kernel_ms=0.5, call_ms=0.6, graph_ms=0.55, host_us=12.0)
    base = Times(kernel_ms=1.0, call_ms=0.9, graph_ms=None, graph_error="capture failed")
    cfg = ConfigResult(params=PARAMS, dtype="float16", verdict=Verdict.PASS, ms=0.6,
                       baseline_ms=0.9, speedup=1.5, baseline_name="sdpa", times=times,
                       baseline_times={"sdpa": base})
    res = EvalResult(verdict=Verdict.PASS, reason="", fitness=1.5, configs=(cfg,),
                     device="NVIDIA H100 80GB HBM3", timing_device="cuda",
                     versions={"torch": "2.13.0"}, device_info={"capability": "9.0"})
    build_run(tmp_path / "run", [dataclasses.replace(make("seed", None, 1.5, 0), result=res)])
    readme = export_run(tmp_path / "run", tmp_path / "out").readme.read_text()
    kernel = readme[readme.index("### kernel"):readme.index("### call")]
    call = readme[readme.index("### call"):readme.index("### graph")]
    graph = readme[readme.index("### graph"):]
    assert "| (1,2,128,64) | float16 | 0.5000 | sdpa | 1.0000 | 2.000× |" in kernel
    assert "| (1,2,128,64) | float16 | 0.6000 | sdpa | 0.9000 | 1.500× |" in call
    assert "| 0.5500 | sdpa | — | — |" in graph and "capture failed" not in graph
    assert "On NVIDIA H100 80GB HBM3" in readme and "compute capability 9.0" in readme
    assert "Host-bound" not in readme              # no issue times: nothing said of them
    launch = dataclasses.replace(cfg, times=dataclasses.replace(times, issue_us=590.0))
    build_run(tmp_path / "run2", [dataclasses.replace(make("seed", None, 1.5, 0), result=(
        dataclasses.replace(res, configs=(launch,))))])
    readme = export_run(tmp_path / "run2", tmp_path / "out2").readme.read_text()
    call = readme[readme.index("### call"):readme.index("### graph")]
    assert "Host-bound in call time" in call and "(1,2,128,64)." in call


def test_a_program_of_several_files_exports_each_file(tmp_path):
    main = ("# evoattn: companion helper.py\n# evoattn: companion fast.cu when(@target=sm90)\n"
            "USE_FAST = True  # evoattn: choice(True, False)\n"
            "def attention(q, k, v, causal=False, scale=None):\n    return q\n")
    source = program.join([("hybrid.py", main), ("helper.py", "X = 1\n"),
                           ("fast.cu", 'extern "C" int f() { return 0; }\n')])
    build_run(tmp_path / "run", [make("seed", None, 1.0, 0, source=source)])
    s = export_run(tmp_path / "run", tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "best.py").read_text() == main
    assert (out / "helper.py").read_text() == "X = 1\n"
    assert (out / "fast.cu").read_text() == 'extern "C" int f() { return 0; }\n'
    assert program.split(program.read(out / "best.py"), "best.py").names == (
        "best.py", "helper.py", "fast.cu")        # `evoattn eval best.py` reads all three
    kernel = s.package_dir / "kernel"
    assert sorted(p.name for p in kernel.iterdir()) == ["fast.cu", "helper.py", "hybrid.py"]
    meta = json.loads((s.package_dir / "kernel.json").read_text())
    assert meta["main"] == "hybrid.py" and meta["knobs"] == {"USE_FAST": "True"}
    assert meta["companions"] == [{"name": "helper.py", "when": []},
                                  {"name": "fast.cu", "when": [[["@target", "=", "sm90"]]]}]
    export_run(tmp_path / "run", out)            # again: its own files are no foreign files
    assert (out / "helper.py").is_file()


def test_lineage_runs_from_seed_to_best(run, tmp_path):
    s = export_run(run, tmp_path / "out")
    steps = json.loads(s.lineage_json.read_text())
    assert [x["id"] for x in steps] == ["seed", "a1", "a2", "best"]
    assert [x["fitness"] for x in steps] == [1.0, 1.2, 1.5, 2.0]
    assert steps[1]["mutator"] == "llm:m" and "+BLOCK_M=128" in steps[1]["change"]
    md = s.lineage_md.read_text()
    assert md.index("`seed`") < md.index("`a1`") < md.index("`a2`") < md.index("`best`")
    assert "```diff" in md


def test_lineage_says_which_steps_won_a_duel_and_which_came_along_unproven(tmp_path):
    """A step crowned by a duel, one that lost its duel, one never re-measured beside the best
    (its change is in the best unproven) and one never re-measured whose change won a duel on
    another line: the lineage says which is which."""
    def duelled(p: Program, gain: float, ci: tuple[float, float]) -> Program:
        return dataclasses.replace(p, result=dataclasses.replace(
            p.result, rival="the best of its time", gain=gain, gain_ci=ci))
    build_run(tmp_path / "run", [
        make("seed", None, 1.0, 0),
        duelled(make("won", "seed", 1.1, 1), 1.08, (1.05, 1.11)),
        make("drift", "won", 1.09, 2),
        duelled(make("lost", "drift", 1.1, 3), 1.004, (0.995, 1.013)),
        make("again", "lost", 1.12, 4, change="did won"),    # "won"'s change, on this line
        duelled(make("best", "again", 1.2, 5), 1.09, (1.07, 1.11))])
    s = export_run(tmp_path / "run", tmp_path / "out")
    steps = json.loads(s.lineage_json.read_text())
    assert [x["id"] for x in steps] == ["seed", "won", "drift", "lost", "again", "best"]
    assert [x["duel"] and x["duel"]["won"] for x in steps] == [None, True, None, False, None,
                                                                True]
    assert steps[1]["duel"]["gain_ci"] == [1.05, 1.11]
    md = s.lineage_md.read_text()
    sections = {sid: md[md.index(f"`{sid}`"):] for sid in ("won", "drift", "lost")}
    assert "Beside the best of its time: crowned: 1.080x [1.050, 1.110]." in \
        sections["won"].split("##")[0]
    assert "Beside the best of its time: never re-measured: unproven." in \
        sections["drift"].split("##")[0]
    assert "not faster beyond noise: 1.004x [0.995, 1.013]" in sections["lost"].split("##")[0]
    assert "the same change crowned at iteration 1" in \
        md[md.index("`again`"):].split("##")[0]
    from evoattn.report import crowned_changes
    from evoattn.store import RunStore
    with RunStore.open_readonly(tmp_path / "run") as st:   # read without the sources
        assert crowned_changes(st.judgements()) == \
            crowned_changes(st.load_programs().values()) == {"did won": 1, "did best": 5}
    assert "Beside the best" not in md[md.index("`seed`"):md.index("`won`")]


def test_leaderboard_has_at_most_ten_sorted_correct_rows(run, tmp_path):
    s = export_run(run, tmp_path / "out")
    rows = json.loads(s.leaderboard_json.read_text())
    assert len(rows) == 10
    assert [r["rank"] for r in rows] == list(range(1, 11))
    fit = [r["fitness"] for r in rows]
    assert fit == sorted(fit, reverse=True) and rows[0]["id"] == "best"
    assert all(r["verdict"] == "pass" for r in rows) and "zz" not in {r["id"] for r in rows}
    assert [c["speedup"] for c in rows[0]["speedups"]] == pytest.approx([1.8, 2.2])
    assert rows[0]["speedups"][1]["config"] == "(1,2,128,64) causal"
    md = s.leaderboard_md.read_text().splitlines()
    table = [ln for ln in md if ln.startswith("| ") and "rank" not in ln]
    assert len(table) == 10 and "`best`" in table[0] and "2.200×" in table[0]


def test_cuda_best_is_packaged_in_its_fast_form(tmp_path):
    src = 'extern "C" int evoattn_sdpa(const void* q) { return 0; }\n'
    build_run(tmp_path / "run", [make("seed", None, 1.0, 0, suffix=".cu", source=src)])
    s = export_run(tmp_path / "run", tmp_path / "out")
    assert s.best_source.name == "best.cu" and s.best_source.read_text() == src
    meta = json.loads((s.package_dir / "kernel.json").read_text())
    assert meta["form"] == "cuda-fast" and meta["main"] == "best.cu" and s.has_op
    assert "triton" not in (tmp_path / "out" / "pyproject.toml").read_text()
    readme = s.readme.read_text()
    assert "nvcc" in readme and "evoattn eval best.cu" in readme


def test_export_accepts_an_open_store(run, tmp_path):
    with RunStore.open(run, None, create=False) as store:
        assert export_run(store, tmp_path / "out").best_id == "best"


def test_no_correct_program_is_a_run_dir_error_and_writes_nothing(tmp_path):
    build_run(tmp_path / "run", [make("seed", None, 1.0, 0, verdict=Verdict.INCORRECT)])
    out = tmp_path / "out"
    with pytest.raises(RunDirError, match="no correct program to export .*1 incorrect"):
        export_run(tmp_path / "run", out)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_failure_before_writing_creates_nothing(run, tmp_path, monkeypatch):
    def boom(*args):
        raise OSError("disk full")
    monkeypatch.setattr(export_mod.docs, "readme", boom)
    with pytest.raises(OSError):
        export_run(run, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_failure_while_writing_files_cleans_the_temp_dir(run, tmp_path, monkeypatch):
    calls = []
    real = export_mod.Path.write_text

    def flaky(self, text, *a, **kw):
        calls.append(self.name)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(self, text, *a, **kw)
    monkeypatch.setattr(export_mod.Path, "write_text", flaky)
    with pytest.raises(OSError, match="disk full"):
        export_run(run, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_reexport_replaces_a_previous_export(run, tmp_path):
    out = tmp_path / "out"
    export_run(run, out)
    (out / "best.py").write_text("stale")
    export_run(run, out)
    assert "the best" in (out / "best.py").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]


def test_refuses_to_replace_a_directory_with_foreign_files(run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    with pytest.raises(RunDirError, match="thesis.tex"):
        export_run(run, out)
    assert (out / "thesis.tex").read_text() == "precious"


def test_cpu_timings_are_labelled(tmp_path):
    p = make("seed", None, 1.0, 0)
    p = Program(**{**p.__dict__, "result": EvalResult(
        verdict=Verdict.PASS, reason="", fitness=1.0, configs=p.result.configs,
        device="cpu", timing_device="cpu")})
    build_run(tmp_path / "run", [p])
    s = export_run(tmp_path / "run", tmp_path / "out")
    assert "Timed on CPU" in s.leaderboard_md.read_text()
    assert "taken on CPU" in s.readme.read_text()


def test_leaderboard_keeps_configs_that_differ_only_in_extra_params(tmp_path):
    cfgs = tuple(ConfigResult(params={"B": 1, "H": 2, "S": 256, "D": 64, "window": w},
                              dtype="float16", verdict=Verdict.PASS, ms=1.0, baseline_ms=s,
                              speedup=s) for w, s in ((32, 0.5), (64, 3.0)))
    res = EvalResult(verdict=Verdict.PASS, reason="", fitness=1.2, configs=cfgs, device="d")
    build_run(tmp_path / "run", [dataclasses.replace(make("seed", None, 1.2, 0), result=res)])
    export_run(tmp_path / "run", tmp_path / "out")
    md = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "window=32" in md and "0.500×" in md and "window=64" in md and "3.000×" in md
