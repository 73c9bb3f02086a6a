"""Ready-to-fill kernel files for `evoattn new-kernel`: a problem's entry (for `.cu` also the
launcher and the float16/bfloat16/float32 dispatch) around a simple correct body to replace.

The files' text lives in skeleton_templates/<problem><suffix>, with the problem's contract
filled in from the problem itself, so the skeleton and `evoattn problems` say the same thing.
"""
from __future__ import annotations

import string
import textwrap
from pathlib import Path

from .errors import UsageError
from .problem_lookup import load_problem

TEMPLATES = Path(__file__).resolve().parent / "skeleton_templates"
FORMS = {"cu": ".cu", "py": ".py"}


def target(path: Path, form: str | None) -> Path:
    """Returns the file to write: PATH, given the suffix of `form` when it has no .cu/.py one;
    a PATH whose suffix disagrees with `form`, or neither saying which form, is a UsageError."""
    if path.suffix in FORMS.values():
        if form is not None and FORMS[form] != path.suffix:
            raise UsageError(f"{path}: a {path.suffix} file cannot hold the {form} form "
                             f"(name it {path.with_suffix(FORMS[form]).name}, or drop --form)")
        return path
    if form is None:
        raise UsageError(f"{path}: name a .cu or .py file, or give --form cu|py")
    return path.with_name(path.name + FORMS[form])


def skeleton_text(problem: str, suffix: str, name: str) -> str:
    """Returns the skeleton of `problem` in the form of `suffix`, naming itself `name`."""
    prob = load_problem(problem)                 # an unknown name: its one-line error first
    template = TEMPLATES / f"{problem}{suffix}"
    if problem.endswith(".py") or not template.is_file():
        have = sorted(f"{p.stem} ({p.suffix})" for p in TEMPLATES.iterdir())
        raise UsageError(f"--problem {problem}: new-kernel has no {suffix} skeleton for it "
                         f"(it has: {', '.join(have)}); start from a seed under seeds/ instead")
    contract = textwrap.wrap(prob.contract, 88)
    prefix = "// " if suffix == ".cu" else ""
    return string.Template(template.read_text()).substitute(
        name=name, contract="\n".join(prefix + line for line in contract))


def write_skeleton(path: Path, problem: str, form: str | None) -> Path:
    """Writes the skeleton to PATH (see target) and returns it; an existing file is never
    overwritten (a UsageError)."""
    out = target(path, form)
    if out.exists():
        raise UsageError(f"{out}: already exists; new-kernel never overwrites a file")
    text = skeleton_text(problem, out.suffix, out.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(out, "x", encoding="utf-8") as f:    # "x": not even one created meanwhile
            f.write(text)
    except FileExistsError:
        raise UsageError(f"{out}: already exists; new-kernel never overwrites a file") from None
    return out
