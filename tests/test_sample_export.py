"""examples/sample_run/export is what `evoattn export` writes today: its package files and README
equal the ones the present templates give for its kernel and evidence. When a template
changes, rewrite the sample with `python tests/test_sample_export.py --write`."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPORT = ROOT / "examples" / "sample_run" / "export"


def _expected() -> tuple[Path, dict[str, str]]:
    """Returns (the sample's package directory, {path under the export: text} as written today)."""
    from evoattn.contract import program
    from evoattn.contract.types import EvalResult
    from evoattn import export_docs
    from evoattn.export_package import describe, package_files
    from evoattn.types import Program
    (pkg,) = [p for p in EXPORT.iterdir() if p.is_dir() and p.name.startswith("evoattn_")]
    meta = json.loads((pkg / "kernel.json").read_text())
    source = program.join([(n, (pkg / "kernel" / n).read_text()) for n in meta["files"]])
    result = EvalResult.from_json(json.loads((EXPORT / "best_eval.json").read_text()))
    best = Program(id=meta["program_id"], source=source, suffix=".py", parent_id=None,
                   iteration=0, island=0, mutator="", change="", result=result)
    info = describe(best, meta["problem"], meta["user_problem"], meta["entry"])
    assert info.meta == meta, "the sample's kernel.json is not what describe() gives"
    evidence = {n: (EXPORT / n).read_text() for n in ("best_eval.json", "lineage.json")}
    return pkg, {**package_files(info, evidence), "README.md": export_docs.readme(best, info)}


def test_the_sample_package_is_what_the_templates_write():
    pkg, expected = _expected()
    stale = [rel for rel, text in expected.items()
             if not (EXPORT / rel).is_file() or (EXPORT / rel).read_text() != text]
    assert not stale, (f"{stale} differ from what the templates write: "
                       "python tests/test_sample_export.py --write")
    shipped = {str(p.relative_to(EXPORT)) for p in pkg.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert shipped == {rel for rel in expected if rel.startswith(pkg.name + "/")}


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(f"usage: python {sys.argv[0]} --write")
    sys.path.insert(0, str(ROOT))
    package, files = _expected()
    shutil.rmtree(package)
    for rel, text in files.items():
        (EXPORT / rel).parent.mkdir(parents=True, exist_ok=True)
        (EXPORT / rel).write_text(text)
    print(f"rewrote {len(files)} files under {EXPORT}")
