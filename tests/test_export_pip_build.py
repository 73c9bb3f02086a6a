"""`pip install RUN/best`, as the end of a run advises, leaves the run able to go on and export."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from evoattn.errors import RunDirError
from evoattn.outdir import build_leftovers

ROOT = Path(__file__).resolve().parent.parent


def _evoattn(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoattn.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


def _pip_install(package_dir: Path, target: Path) -> None:
    """Installs the export into `target` (not this environment), building in place as pip does."""
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", "--target", str(target), str(package_dir)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_run_resumes_and_exports_after_pip_install_of_its_best(tmp_path: Path) -> None:
    run = tmp_path / ("a-run-directory-whose-name-is-long-enough-to-pass-a-line-" * 3) / "run"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({
        "problem": "sdpa", "seed": str(ROOT / "seeds/sdpa/naive_torch.py"),
        "configs": ["1,2,64,64,nc"], "device": "cpu", "iterations": 1, "random_seed": 0,
        "output": str(run), "evaluator": {"trials": 1, "run_timeout_s": 300}}))
    first = _evoattn("run", "--config", str(cfg), "--quiet")
    assert first.returncode == 0, first.stdout + first.stderr
    # the advice prints whole into a file: each command in it on one line, to copy as it is
    hint = next(ln for ln in first.stdout.splitlines() if ln.startswith("best kernel exported"))
    assert f"`pip install {run / 'best'}`, then `import evoattn_sdpa_" in hint
    assert f"(re-check it with `evoattn eval {run / 'best'}/best.py --device cpu" in hint
    best = run / "best"
    _pip_install(best, tmp_path / "site")
    dist = json.loads((best / "export.json").read_text())["dist"]
    left = build_leftovers(best, dist)
    assert "build" in left and any(n.endswith(".egg-info") for n in left), sorted(
        p.name for p in best.iterdir())            # the build really wrote into the export
    again = _evoattn("run", "--config", str(cfg), "--quiet", "--iterations", "2")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resuming the run" in again.stdout
    exported = _evoattn("export", str(run))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    # the old build went with the old export; the new export is whole
    assert not build_leftovers(best, dist) and (best / "best.py").is_file()


def _export_dir(tmp_path: Path, dist: str = "evoattn-sdpa-0a1b") -> Path:
    out = tmp_path / "best"
    out.mkdir()
    (out / "export.json").write_text(json.dumps({"dist": dist, "files": ["export.json"]}))
    return out


def test_build_leftovers_names_setuptools_build_files_only(tmp_path: Path) -> None:
    out = _export_dir(tmp_path)
    (out / "build" / "lib").mkdir(parents=True)
    (out / "build" / "bdist.linux-x86_64").mkdir()
    (out / "evoattn_sdpa_0a1b.egg-info").mkdir()
    (out / "dist").mkdir()
    (out / "dist" / "evoattn_sdpa_0a1b-1.0.0-py3-none-any.whl").write_text("")
    (out / "other.egg-info").mkdir()                  # another package's: not ours
    assert build_leftovers(out, "evoattn-sdpa-0a1b") == {
        "build", "dist", "evoattn_sdpa_0a1b.egg-info"}
    (out / "build" / "notes.txt").write_text("mine")  # the user's file: build/ is theirs now
    assert "build" not in build_leftovers(out, "evoattn-sdpa-0a1b")


def test_an_export_still_refuses_a_directory_with_the_users_files(tmp_path: Path) -> None:
    from evoattn.export import _replaceable
    from evoattn.outdir import replace_directory
    out = _export_dir(tmp_path)
    (out / "build").mkdir()
    (out / "build" / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="build"):
        replace_directory(out, {"export.json": "{}"}, _replaceable, "an export", "no")
    assert (out / "build" / "notes.txt").read_text() == "mine"
