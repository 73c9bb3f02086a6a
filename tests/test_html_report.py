"""`evoattn report`: a real run directory, the page opened in a real headless Chromium."""
from __future__ import annotations

import dataclasses
import hashlib
import html
import itertools
import random
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
mpimg = pytest.importorskip("matplotlib.image")

from evoattn.contract.types import EvalResult, Times, Verdict  # noqa: E402
from evoattn.config import PopulationConfig, RunConfig, config_to_dict  # noqa: E402
from evoattn import charts  # noqa: E402
from evoattn.html_report import write_report  # noqa: E402
from evoattn.mutators.knobs import KnobMutator  # noqa: E402
from evoattn.report_data import lineage  # noqa: E402
from evoattn.search import Search  # noqa: E402
from evoattn.store import RunStore  # noqa: E402
from evoattn.types import LlmUsage, MutationRequest, Program, Proposal  # noqa: E402
from fakes import TOY_SEED, FakeEvaluator  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASELINES = {"sdpa": 1.0, "naive": 3.0}      # baseline name -> its time relative to "sdpa"


@dataclasses.dataclass
class TimedEvaluator(FakeEvaluator):
    """FakeEvaluator's scores with what a real result carries: every mode, every baseline."""

    gate: threading.Event | None = None      # evaluations past `pause_after` wait on it
    pause_after: int = 0
    paused: threading.Event = dataclasses.field(default_factory=threading.Event)

    def evaluate(self, source: str, suffix: str, label: str = "",
                 rival: str | None = None) -> EvalResult:
        if self.gate is not None and len(self.calls) >= self.pause_after:
            self.paused.set()
            self.gate.wait(60)
        r = super().evaluate(source, suffix, label, rival)
        stages = {"scan": 0.01, "build": 0.2, "check": 0.5, "time": 1.5}
        if not r.correct:
            return dataclasses.replace(r, stage_s=stages, timing_device="cpu")
        configs = []
        for params in ({"B": 1, "H": 2, "S": 64, "D": 64, "causal": False},
                       {"B": 1, "H": 2, "S": 128, "D": 64, "causal": True}):
            base = {name: Times(kernel_ms=f * 2.0, call_ms=f * 2.5, host_us=9.0)
                    for name, f in BASELINES.items()}
            # the kernel-time speedup is 1.25x the call-time one: only the call cells (the
            # run's timing mode) equal the fitness
            mine = Times(kernel_ms=1.6 / r.fitness, call_ms=2.5 / r.fitness, host_us=9.0)
            configs.append(dataclasses.replace(
                r.configs[0], params=params, times=mine, baseline_times=base,
                baselines={n: t.call_ms for n, t in base.items()}, baseline_name="sdpa",
                ms=mine.call_ms, baseline_ms=base["sdpa"].call_ms, speedup=r.fitness))
        return dataclasses.replace(r, configs=tuple(configs), stage_s=stages, device="cpu",
                                   timing_device="cpu", timing="call", baseline="best")


class PricedMutator:
    """The knob mutator with an LLM call's usage on each proposal (what llm_calls records)."""

    name = "llm:fake-model"

    def __init__(self, inner: KnobMutator) -> None:
        self.inner = inner

    def propose(self, request: MutationRequest) -> Proposal:
        p = self.inner.propose(request)
        usage = LlmUsage("fake-model", prompt_tokens=1200, completion_tokens=300,
                         cost_usd=0.004, latency_s=1.5)
        return dataclasses.replace(p, mutator=self.name, usage=usage)


def _run(run_dir: Path, iterations: int = 24, ev: TimedEvaluator | None = None,
         llm: bool = True) -> Search:
    cfg = RunConfig(iterations=iterations, random_seed=3, device="cpu",
                    population=PopulationConfig(islands=2, elites_per_island=3,
                                                migration_interval=5))
    ticks = itertools.count()
    store = RunStore.open(run_dir, config_to_dict(cfg), create=True,
                          clock=lambda: 1.7e9 + 9.0 * next(ticks))   # 9 s between writes
    holder: dict[str, Search] = {}
    knobs = KnobMutator(0.3, is_known=lambda pid: holder["s"].known(pid))
    mutators = [(knobs, 1.0)] + ([(PricedMutator(knobs), 1.0)] if llm else [])
    ev = ev or TimedEvaluator(fail_when={"STAGES": "4"})
    search = Search(cfg, store, ev, mutators, TOY_SEED, ".py")
    holder["s"] = search
    try:
        search.run()
    finally:
        store.close()
    return search


def _best_fitness(run_dir: Path) -> float:
    with RunStore.open_readonly(run_dir) as st:
        return st.leaderboard(1)[0].fitness


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("needs a Chromium binary on PATH (Debian: apt-get install -y chromium); "
                "none of chromium, chromium-browser, google-chrome was found")


def _browse(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={profile}", "--hide-scrollbars", *args,
           page.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _pixels(png: Path) -> np.ndarray:
    """Returns an image's RGB as floats in [0, 1] (H, W, 3); fails if it is not a PNG."""
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{png} is not a PNG"
    return mpimg.imread(str(png))[..., :3]


def _drawn_on(rgb: np.ndarray) -> tuple[float, int]:
    """Returns the share of non-white pixels and the number of distinct (quantised) colours."""
    ink = (rgb < 0.94).any(axis=-1).mean()
    colours = np.unique((rgb * 15).round().astype(int).reshape(-1, 3), axis=0)
    return float(ink), len(colours)


def _has_colour(rgb: np.ndarray, hex_colour: str, at_least: int) -> bool:
    want = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(rgb - want).max(axis=-1) < 0.06).sum()) >= at_least


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("report") / "toy-run"
    _run(run_dir)
    return run_dir


def test_report_page_draws_every_chart_in_headless_chromium(finished_run: Path,
                                                              tmp_path: Path) -> None:
    page = write_report(finished_run, tmp_path / "out")
    shot = tmp_path / "shot.png"
    _browse(page, tmp_path / "profile", "--window-size=1200,3000", f"--screenshot={shot}")
    rgb = _pixels(shot)
    ink, colours = _drawn_on(rgb)
    assert rgb.shape[:2] == (3000, 1200)
    assert ink > 0.1 and colours > 40, (ink, colours)
    # The fitness chart's best-so-far line is in the screenshot: the images were decoded and
    # drawn, not replaced by broken-image icons.
    assert _has_colour(rgb, "#2ca02c", at_least=2000)
    assert _has_colour(rgb, "#1f77b4", at_least=2000)


def test_every_image_on_the_page_is_a_drawn_png_that_chromium_loads(finished_run: Path,
                                                                     tmp_path: Path) -> None:
    page = write_report(finished_run, tmp_path / "out")
    text = page.read_text()
    sources = re.findall(r'<img src="([^"]+)"', text)
    assert sorted(sources) == ["fitness.png", "lineage.png", "llm.png", "speedup.png",
                               "throughput.png", "verdicts.png"]
    for src in sources:
        ink, colours = _drawn_on(_pixels(page.parent / src))
        assert ink > 0.02 and colours > 8, (src, ink, colours)
    # A copy of the page that lists what Chromium made of each <img> once the page loaded.
    probe = page.with_name("probe.html")
    probe.write_text(text.replace("</body>", "<script>addEventListener('load', () => "
                                  "document.body.dataset.images = [...document.images].map("
                                  "i => i.getAttribute('src') + '=' + i.naturalWidth + 'x' + "
                                  "i.naturalHeight).join(' '))</script></body>"))
    dom = _browse(probe, tmp_path / "profile", "--virtual-time-budget=5000", "--dump-dom").stdout
    loaded = dict(item.split("=") for item in
                  re.search(r'data-images="([^"]*)"', dom).group(1).split())
    assert sorted(loaded) == sorted(sources)
    for src, size in loaded.items():
        w, h = (int(v) for v in size.split("x"))
        assert w > 300 and h > 200, (src, size)


def test_page_names_the_run_and_its_best(finished_run: Path, tmp_path: Path) -> None:
    page = write_report(finished_run, tmp_path / "out")
    dom = _browse(page, tmp_path / "profile", "--dump-dom").stdout
    text = html.unescape(re.sub(r"<[^>]+>", " ", dom))
    best = _best_fitness(finished_run)
    assert f"{best:.4f}" in text
    assert "toy-run" in text and "sdpa" in text
    assert "CPU timings" in text
    assert "call time" in text and "kernel time" in text
    # Every baseline and mode is in the table: (1,2,64,64) against naive is 3x sdpa's time.
    assert f"{3.0 * best:.3f}×" in text and f"{best:.3f}×" in text
    assert "Not measured: graph time" in text


def test_page_shows_the_end_of_run_re_measurement_beside_the_seed(finished_run: Path,
                                                                   tmp_path: Path) -> None:
    """Where the run re-measured its best beside the seed at the end, the summary's seed -> best
    is that duel's (not the seed's first reading against the best's own), with every mode."""
    from fakes import duel_result
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    with RunStore.open_readonly(run) as st:
        best, seed = st.champion(), st.load_programs()
    seed_id = next(p.id for p in seed.values() if p.parent_id is None)
    store = RunStore.open(run, None, create=False)
    try:
        store.record_side_by_side(seed_id, best.id, duel_result(1.2345, 1.1111, 0.01))
    finally:
        store.close()
    page = write_report(run, tmp_path / "out")
    dom = _browse(page, tmp_path / "profile", "--dump-dom").stdout
    text = html.unescape(re.sub(r"<[^>]+>", " ", dom))
    assert "1.1111 → 1.2345 (+11.1%), re-measured side by side" in text
    assert f"seed ({seed_id}) and best ({best.id}) re-measured side by side" in text
    assert "best vs seed 1.111x [1.100, 1.122]: the best is faster" in text


def test_page_lists_the_changes_set_back_at_the_end_of_the_run(finished_run: Path,
                                                                tmp_path: Path) -> None:
    """Where the end of the run set changes back for this best, the summary lists each with its
    duel; a record for another best is not shown."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    with RunStore.open_readonly(run) as st:
        best = st.champion()
    steps = [{"change": "STAGES: 4 -> 2", "program": best.id, "kept_back": True,
              "verdict": "pass", "gain": 1.001, "gain_ci": [0.996, 1.006]},
             {"change": "BLOCK_M: 128 -> 64", "program": "0" * 16, "kept_back": False,
              "verdict": "pass", "gain": 0.8, "gain_ci": [0.79, 0.81]}]
    store = RunStore.open(run, None, create=False)
    try:
        store.record_pruned("f" * 16, best.id, steps)
    finally:
        store.close()
    page = write_report(run, tmp_path / "out")
    dom = _browse(page, tmp_path / "profile", "--dump-dom").stdout
    text = html.unescape(re.sub(r"<[^>]+>", " ", dom))
    assert f"set back at the end of the run, beside the best it had ({'f' * 16})" in text
    assert "STAGES: 4 -> 2: 1.001x [0.996, 1.006]: costs nothing, set back" in text
    assert "BLOCK_M: 128 -> 64: 0.800x [0.790, 0.810]: it pays, kept" in text
    store = RunStore.open(run, None, create=False)
    try:
        store.record_pruned("f" * 16, "e" * 16, steps)           # another best's record
    finally:
        store.close()
    page = write_report(run, tmp_path / "out2")
    assert "set back at the end of the run" not in page.read_text()


def test_speedup_table_marks_the_fitness_term(finished_run: Path, tmp_path: Path) -> None:
    page = write_report(finished_run, tmp_path / "out").read_text()
    best = _best_fitness(finished_run)
    terms = re.findall(r'class="num fitness-term">([0-9.]+)×', page)
    assert terms == [f"{best:.3f}"] * 2          # sdpa, call time, on each of the 2 configs


def test_report_without_llm_calls_says_so_and_draws_no_llm_chart(tmp_path: Path) -> None:
    _run(tmp_path / "run", iterations=6, llm=False)
    page = write_report(tmp_path / "run")
    assert page == tmp_path / "run" / "report" / "report.html"
    assert not (page.parent / "llm.png").exists()
    assert "made no LLM calls" in page.read_text()


def test_report_of_a_run_whose_seed_is_not_stored_yet_says_so_in_words(tmp_path: Path) -> None:
    RunStore.open(tmp_path / "run", config_to_dict(RunConfig(device="cpu")), create=True).close()
    page = write_report(tmp_path / "run")
    text = page.read_text()
    assert "<img" not in text and sorted(p.name for p in page.parent.iterdir()) == [
        "report.html"]
    assert "No candidate has been evaluated yet." in text
    assert "no correct program yet" in text


def test_report_reads_a_run_in_progress_without_writing_to_it(tmp_path: Path) -> None:
    gate = threading.Event()
    ev = TimedEvaluator(gate=gate, pause_after=6)
    runner = threading.Thread(target=_run, args=(tmp_path / "run", 12, ev))
    runner.start()
    try:
        assert ev.paused.wait(60), "the search never reached its pause"
        db = tmp_path / "run" / "run.sqlite"
        before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                  for p in (db, db.with_name("run.sqlite-wal")) if p.exists()}
        page = write_report(tmp_path / "run", tmp_path / "live")
        after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in (db, db.with_name("run.sqlite-wal")) if p.exists()}
        assert before == after                   # the database is untouched by the report
        text = page.read_text()
        assert "no stop recorded: running now" in text
        assert (page.parent / "fitness.png").is_file()
    finally:
        gate.set()
        runner.join(60)
    assert not runner.is_alive()
    with RunStore.open_readonly(tmp_path / "run") as st:
        assert st.load_state()["iteration"] == 12     # the run went on and finished


def test_report_replaces_an_old_report_but_not_a_foreign_directory(finished_run: Path,
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_report(finished_run, out)
    (out / "fitness.png").write_bytes(b"stale")
    write_report(finished_run, out)
    assert (out / "fitness.png").read_bytes()[:4] == b"\x89PNG"
    (out / "notes.txt").write_text("mine")
    result = _cli("report", str(finished_run), "--out", str(out))
    assert result.returncode == 4 and "notes.txt" in result.stderr
    assert (out / "notes.txt").read_text() == "mine"


def _cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"{prelude}import sys; from evoattn.cli import main; sys.argv = ['evoattn'] + " \
           f"{list(args)!r}; main()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_cli_writes_the_report_into_the_run_directory(finished_run: Path) -> None:
    result = _cli("report", str(finished_run))
    assert result.returncode == 0, result.stderr
    assert (finished_run / "report" / "report.html").is_file()
    assert "report written" in result.stdout


def test_cli_exits_4_with_one_line_for_a_missing_run_directory(tmp_path: Path) -> None:
    result = _cli("report", str(tmp_path / "nowhere"))
    assert result.returncode == 4
    assert result.stderr.strip().count("\n") == 0
    assert "not a run directory" in result.stderr


def test_cli_exits_4_naming_the_extra_when_matplotlib_is_missing(finished_run: Path) -> None:
    result = _cli("report", str(finished_run),
                  prelude="import sys; sys.modules['matplotlib'] = None; ")
    assert result.returncode == 4
    hint = 'pip install -e ".[report]"'       # the README's words for the same install
    assert hint in result.stderr and result.stderr.strip().count("\n") == 0
    assert hint in (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _program(pid: str, parent: str | None, iteration: int, fitness: float,
             second: str | None = None) -> Program:
    return Program(pid, f"# {pid}\n", ".py", parent, iteration, 0, "knobs" if parent else "seed",
                   f"made {pid}", EvalResult(Verdict.PASS, "ok", fitness), second)


def test_lineage_follows_first_parents_with_gains_and_hangs_the_crossover_partner(
        tmp_path: Path) -> None:
    programs = {p.id: p for p in [
        _program("seed", None, 0, 1.0), _program("a", "seed", 1, 1.2),
        _program("b", "seed", 2, 1.1), _program("c", "a", 3, 1.15, second="b"),
        _program("side", "c", 4, 2.0), _program("d", "c", 5, 1.3)]}
    nodes = lineage("d", programs)
    assert [n.program_id for n in nodes] == ["seed", "a", "c", "d"]
    assert nodes[0].gain is None
    assert [round(n.gain, 6) for n in nodes[1:]] == [0.2, -0.05, 0.15]
    assert [n.partner.program_id if n.partner else None for n in nodes] == [None, None, "b",
                                                                             None]
    png = tmp_path / "lineage.png"
    png.write_bytes(charts.lineage_chart(nodes * 3) or b"")    # two rows, partners above
    ink, colours = _drawn_on(_pixels(png))
    assert ink > 0.02 and colours > 8


def test_lineage_says_how_each_step_fared_beside_the_best_of_its_time(
        finished_run: Path) -> None:
    """Crowned by a duel, beaten in one, never re-measured, or never re-measured but the same
    change crowned elsewhere: the page's lineage table says which."""
    def duelled(p: Program, gain: float, ci: tuple[float, float]) -> Program:
        return dataclasses.replace(p, result=dataclasses.replace(
            p.result, rival="best", gain=gain, gain_ci=ci))
    twin = dataclasses.replace(_program("twin", "seed", 1, 1.1), change="made a")
    programs = {p.id: p for p in [
        _program("seed", None, 0, 1.0), duelled(twin, 1.08, (1.05, 1.11)),
        duelled(_program("a", "seed", 2, 1.1), 1.002, (0.99, 1.01)),
        _program("b", "a", 3, 1.12), _program("c", "b", 4, 1.13),
        duelled(_program("d", "c", 5, 1.3), 1.15, (1.12, 1.18))]}
    programs["c"] = dataclasses.replace(programs["c"], change="made a")     # twin's change
    nodes = lineage("d", programs)
    assert [n.program_id for n in nodes] == ["seed", "a", "b", "c", "d"]
    assert [n.judged for n in nodes] == [
        "", "not faster beyond noise: 1.002x [0.990, 1.010]", "never re-measured: unproven",
        "not re-measured; the same change crowned at iteration 1",
        "crowned: 1.150x [1.120, 1.180]"]
    from evoattn.html_report import render
    from evoattn.report_data import load_run
    page = render(dataclasses.replace(load_run(finished_run), lineage=nodes), set())
    assert "<th>beside the best of its time</th>" in page
    assert "<td>never re-measured: unproven</td>" in page


def _crowned_run(run_dir: Path) -> None:
    """A run like the one a loaded CPU gave: a child read high once, never confirmed beside
    the best; another child won its duel and is the best."""
    from fakes import duel_result
    loud = _program("loud", "seed", 1, 0.165)                   # a plain reading only
    won = dataclasses.replace(_program("won", "seed", 2, 0.12),
                              result=duel_result(0.12, 0.0969, 0.01))
    steps = [_program("seed", None, 0, 0.0969), loud, won, _program("late", "won", 3, 0.11)]
    with RunStore.open(run_dir, config_to_dict(RunConfig(device="cpu")), create=True) as s:
        for i, p in enumerate(steps):
            s.commit_iteration(iteration=i, program=p, rejection=None, llm_usage=None,
                               rng_state=random.Random(i).getstate(), population_snapshot={
                                   "champion": "won" if i >= 2 else "seed"})


def _header_best(page: Path) -> float:
    row = re.search(r"<th>seed → best fitness</th><td>([^<]*)</td>", page.read_text()).group(1)
    return float(html.unescape(row).split("→")[1].split()[0])


def test_the_fitness_charts_best_so_far_ends_at_the_headers_best(tmp_path: Path) -> None:
    from evoattn.report_data import load_run
    _crowned_run(tmp_path / "run")
    page = write_report(tmp_path / "run")
    data = load_run(tmp_path / "run")
    xs, ys = charts.best_so_far(data.best_line, 3)
    assert (xs, ys) == ([0, 2, 3], [0.0969, 0.12, 0.12])       # the seed, then the duel's won
    assert ys[-1] == _header_best(page) == 0.12 and max(ys) < 0.165
    assert (page.parent / "fitness.png").is_file()


def test_the_best_so_far_ends_at_the_end_of_run_re_measurement(tmp_path: Path) -> None:
    from fakes import duel_result
    from evoattn.report_data import load_run
    _crowned_run(tmp_path / "run")
    store = RunStore.open(tmp_path / "run", None, create=False)
    try:
        store.record_side_by_side("seed", "won", duel_result(0.1111, 0.0950, 0.01))
    finally:
        store.close()
    page = write_report(tmp_path / "run")
    _, ys = charts.best_so_far(load_run(tmp_path / "run").best_line, 3)
    assert ys[-1] == _header_best(page) == 0.1111
