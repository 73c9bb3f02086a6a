"""Exports a run's best kernel as a pip-installable package, with its evidence.

An export directory holds the kernel as the run evaluated it (`best.py` or `best.cu` and its
companion files), its evaluation, lineage and leaderboard, a README, and the package
(`pyproject.toml` and `evoattn_<problem>_<id>/`, see export_package.py). Everything is
written into a temporary sibling directory renamed into place at the end, so a failed export
never leaves half a directory behind.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from evoattn.problems import builtin_names
from evoattn.problems import get_problem as builtin_problem

from . import export_docs as docs
from .errors import RunDirError
from .export_package import KernelInfo, describe, package_files
from .outdir import build_leftovers, replace_directory
from .report import crowned_changes
from .store import RunStore
from .types import Program

LEADERBOARD_SIZE = 10
MANIFEST = "export.json"
# Names every export writes; an existing out_dir holding only these (or the names its own
# manifest lists) is an earlier export, and is replaced.
_EXPORT_NAMES = {"best.py", "best.cu", "best_eval.json", "lineage.md", "lineage.json",
                 "leaderboard.md", "leaderboard.json", "README.md", "pyproject.toml",
                 "side_by_side.json", "set_back.json", MANIFEST}


@dataclasses.dataclass(frozen=True)
class ExportSummary:
    """Where an export put each file, and what it exported."""

    out_dir: Path
    best_source: Path
    best_eval: Path
    lineage_md: Path
    lineage_json: Path
    leaderboard_md: Path
    leaderboard_json: Path
    readme: Path
    package_dir: Path
    package: str                       # the import name
    namespace: str                     # torch.ops.<namespace>.attention
    has_op: bool
    best_id: str
    best_fitness: float
    lineage_length: int


def export_run(store_or_run_dir: RunStore | str | Path, out_dir: str | Path) -> ExportSummary:
    """Writes the best correct program, its package and its evidence into out_dir."""
    if isinstance(store_or_run_dir, RunStore):
        return _export(store_or_run_dir, Path(out_dir))
    store = RunStore.open_readonly(store_or_run_dir)
    try:
        return _export(store, Path(out_dir))
    finally:
        store.close()


def _export(store: RunStore, out_dir: Path) -> ExportSummary:
    best = store.champion()
    if best is None:
        counts = store.counts_by_verdict()
        seen = ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) or "no programs"
        raise RunDirError(f"{store.run_dir}: no correct program to export ({seen})")
    # the leaderboard's rows by fitness, and the best's own row wherever it ranks
    board = list(enumerate(store.leaderboard(LEADERBOARD_SIZE), 1))
    if all(p.id != best.id for _, p in board):
        board.append((store.rank(best), best))
    lineage = store.lineage(best.id)
    info = _kernel_info(best, store.meta().get("problem", ""))
    evidence = {"best_eval.json": docs.dump(best.result.to_json() if best.result else {}),
                "lineage.json": docs.dump([docs.lineage_entry(i, p)
                                           for i, p in enumerate(lineage)])}
    beside_seed = store.side_by_side(best.id)       # the run's last word on best vs seed
    if beside_seed is not None:
        seed_id, duel = beside_seed
        evidence["side_by_side.json"] = docs.dump({"seed": seed_id, "best": best.id,
                                                   **duel.to_json()})
    set_back = store.set_back(best.id)              # the changes set back at the end
    if set_back is not None:
        evidence["set_back.json"] = docs.dump(set_back)
    files = {**_program_files(best, info), **evidence,
             "lineage.md": docs.lineage_md(lineage,
                                           crowned_changes(store.judgements())),
             "leaderboard.md": docs.leaderboard_md(board, best.id),
             "leaderboard.json": docs.dump([docs.board_entry(rank, p, p.id == best.id)
                                            for rank, p in board]),
             "README.md": docs.readme(best, info, beside_seed, set_back),
             **package_files(info, evidence)}
    top = sorted({name.split("/", 1)[0] for name in files} | {MANIFEST})
    files[MANIFEST] = docs.dump({"program_id": best.id, "problem": info.problem,
                                 "package": info.names.package, "dist": info.names.dist,
                                 "namespace": info.names.namespace, "has_op": info.has_op,
                                 "files": top})
    replace_directory(out_dir, files, _replaceable, "an export", "choose another directory")
    return ExportSummary(
        out_dir=out_dir, best_source=out_dir / f"best{best.suffix}",
        best_eval=out_dir / "best_eval.json", lineage_md=out_dir / "lineage.md",
        lineage_json=out_dir / "lineage.json", leaderboard_md=out_dir / "leaderboard.md",
        leaderboard_json=out_dir / "leaderboard.json", readme=out_dir / "README.md",
        package_dir=out_dir / info.names.package, package=info.names.package,
        namespace=info.names.namespace, has_op=info.has_op, best_id=best.id,
        best_fitness=best.fitness, lineage_length=len(lineage))


def _kernel_info(best: Program, meta_problem: str) -> KernelInfo:
    """Returns the kernel's description; a user problem's name and entry come from its file."""
    problem = best.result.problem if best.result else (meta_problem or "sdpa")
    user = meta_problem.endswith(".py")
    entry = builtin_problem(problem).entry if problem in builtin_names() and not user \
        else "attention"
    if user:
        try:
            from .problem_lookup import load_problem
            loaded = load_problem(meta_problem)
            problem, entry = loaded.name, loaded.entry
        except Exception:  # noqa: BLE001 - a moved or broken problem file: keep the stored name
            pass
    return describe(best, problem, user, entry)


def _program_files(best: Program, info: KernelInfo) -> dict[str, str]:
    """Returns the program's files as the run evaluated them: the main one as best<suffix>."""
    main = f"best{best.suffix}"
    out = {main: info.files.main_text}
    for name, text in info.files.files[1:]:
        if name in _EXPORT_NAMES or name == main:
            raise RunDirError(f"the best program has a companion file named {name}, which an "
                              "export writes itself")
        out[name] = text
    return out


def _replaceable(out_dir: Path) -> set[str]:
    """Returns the names in out_dir an earlier export wrote (from its manifest), and those a
    pip build of its package left."""
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
        listed = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return set(_EXPORT_NAMES)
    # `pip install out_dir` builds in place: its build/ and egg-info go with the old export
    return set(_EXPORT_NAMES) | {str(n) for n in listed} | \
        build_leftovers(out_dir, str(manifest.get("dist", "")))
