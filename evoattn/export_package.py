"""Lays out an exported kernel as a pip-installable Python package wrapping it as a custom op.

The package's code is the files of evoattn/export_templates/, copied as they are: they read
everything particular to this kernel from the kernel.json written beside them (its names,
its form, what it was verified on). The problem's own module (its op spec, fallback and
transformers route) and what it imports from evoattn/problems/ go to <package>/_problems/,
unchanged. The program's own files go to <package>/kernel/.
"""
from __future__ import annotations

import ast
import functools
import dataclasses
import json
import re
import string
from pathlib import Path
from typing import Any

from evoattn.contract import program as program_files
from evoattn import problems as problem_modules
from evoattn.contract import runtime, runtime_rules
from evoattn.contract.knobs import find_knobs, values_of
from evoattn.contract.types import EvalResult, Verdict

from .types import Program

TEMPLATES = Path(__file__).resolve().parent / "export_templates"
# template file -> its name in the package (the template directory is no package itself)
TEMPLATE_MODULES = {"package_init.py": "__init__.py", "_loader.py": "_loader.py",
                    "guard.py": "guard.py", "hf.py": "hf.py", "ops.py": "ops.py",
                    "problems.py": "problems.py", "decode.py": "decode.py",
                    "_native.py": "_native.py", "_callkey.cpp": "_callkey.cpp",
                    "_meta.py": "_meta.py", "_keys.py": "_keys.py", "_route.py": "_route.py",
                    "_stats.py": "_stats.py", "_hf_fallback.py": "_hf_fallback.py"}
# The evaluator's build, cache key, flags and when(...) rules, shipped unchanged: a package
# builds its kernel exactly as the run that verified it did.
RUNTIME = Path(runtime.__file__).resolve()
RUNTIME_MODULE = "_runtime.py"
# The problem modules, shipped unchanged as <package>/_problems/ (which has no registry).
PROBLEMS = problem_modules.HERE
PROBLEMS_PACKAGE = "_problems"
_PROBLEMS_INIT = '"""The modules of this kernel\'s problem, as evoattn evaluated it."""\n'
RUNTIME_RULES = Path(runtime_rules.__file__).resolve()   # imported by it under its own name
ID_CHARS = 12                          # of the program id, in package and op names


@dataclasses.dataclass(frozen=True)
class PackageNames:
    """The names an export goes by: distribution, import package and op namespace."""

    dist: str                          # evoattn-sdpa-3f2a9c1b0d4e  (pip)
    package: str                       # evoattn_sdpa_3f2a9c1b0d4e  (import)
    namespace: str                     # evoattn_3f2a9c1b0d4e       (torch.ops.<namespace>)


def names_for(problem: str, program_id: str) -> PackageNames:
    """Returns the names of the package exporting one program of one problem."""
    slug = re.sub(r"[^a-z0-9]+", "_", problem.lower()).strip("_") or "problem"
    pid = re.sub(r"[^a-z0-9]", "", program_id.lower())[:ID_CHARS] or "0"
    return PackageNames(dist=f"evoattn-{slug.replace('_', '-')}-{pid}",
                        package=f"evoattn_{slug}_{pid}", namespace=f"evoattn_{pid}")


@dataclasses.dataclass(frozen=True)
class KernelInfo:
    """What the exporter learnt about the kernel: its names, form, op schema and meta."""

    names: PackageNames
    problem: str
    files: program_files.ProgramFiles
    meta: dict[str, Any]

    @property
    def has_op(self) -> bool:
        if self.meta["user_problem"]:
            return bool(self.meta["schema"])
        return problem_modules.has_op(self.meta["problem"])


def describe(best: Program, problem: str, user_problem: bool, entry: str) -> KernelInfo:
    """Returns the kernel's names and the kernel.json its package reads."""
    files = program_files.split(best.source, f"best{best.suffix}")
    names = names_for(problem, best.id)
    main = files.main_name
    form = "python" if main.endswith(".py") else runtime.cuda_form(files.main_text)
    schema = user_schema(files.main_text, entry) if user_problem and form == "python" else None
    meta = {
        "package": names.package, "dist": names.dist, "namespace": names.namespace,
        "program_id": best.id, "problem": problem, "user_problem": user_problem,
        "form": form, "main": main, "entry": entry, "files": list(files.names),
        "companions": [{"name": c.name, "when": [[list(t) for t in g] for g in c.when]}
                       for c in files.companions()],
        "knobs": values_of(find_knobs(files.main_text)),
        "verified": verified_set(best.result),
        "problem_module": None if user_problem else module_name(problem),
        "schema": schema,
    }
    return KernelInfo(names=names, problem=problem, files=files, meta=meta)


def verified_set(result: EvalResult | None) -> dict[str, Any]:
    """Returns what the evaluation verified: device, capability, dtypes, head dims, causal."""
    if result is None:
        return {"device_type": "none", "capabilities": [], "device_name": "", "dtypes": [],
                "head_dims": [], "causal": None}
    passed = [c for c in result.configs if c.verdict is Verdict.PASS]
    # A correct result passed every config in each dtype it names (only the first is timed).
    dtypes = {c.dtype for c in passed} | (set(result.dtypes) if result.correct else set())
    cap = result.device_info.get("capability")
    causal = sorted({bool(c.params["causal"]) for c in passed if "causal" in c.params})
    return {"device_type": result.timing_device, "capabilities": [cap] if cap else [],
            "device_name": result.device, "dtypes": sorted(dtypes),
            "head_dims": sorted({int(c.params["D"]) for c in passed if "D" in c.params}),
            "causal": causal or None, **_feature_sets(result.problem, passed)}


def _feature_sets(problem: str, passed: list[Any]) -> dict[str, list[bool]]:
    """Returns {feature: the values its checked configs had}, for a problem whose module says
    which features a config uses (`verified_flags`): the op's guard checks them per call."""
    if problem not in problem_modules.builtin_names():
        return {}
    flags = getattr(problem_modules.module_of(problem), "verified_flags", None)
    out: dict[str, set[bool]] = {}
    for c in passed if flags is not None else ():
        for name, value in flags(c.params).items():
            out.setdefault(name, set()).add(value)
    return {name: sorted(values) for name, values in out.items()}


# ---- a user problem's op schema, from the entry function's signature ---------------
_SCALARS = {"bool": "bool", "int": "int", "float": "float"}


def user_schema(main_text: str, entry: str) -> str | None:
    """Returns a torch.library schema for the entry function, or None when its signature has
    no schema form (*args, **kwargs, a default that is not a bool/int/float/None literal).

    A parameter without a default is a Tensor unless annotated bool, int or float."""
    try:
        tree = ast.parse(main_text)
    except SyntaxError:
        return None
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == entry), None)
    if fn is None or fn.args.vararg or fn.args.kwarg:
        return None
    positional = fn.args.posonlyargs + fn.args.args
    defaults = [None] * (len(positional) - len(fn.args.defaults)) + list(fn.args.defaults)
    pairs = list(zip(positional, defaults)) + list(zip(fn.args.kwonlyargs, fn.args.kw_defaults))
    parts = []
    for arg, default in pairs:
        part = _schema_param(arg, default)
        if part is None:
            return None
        parts.append(part)
    if not parts or not parts[0].startswith("Tensor "):
        return None
    return f"({', '.join(parts)}) -> Tensor"


def _schema_param(arg: ast.arg, default: ast.expr | None) -> str | None:
    note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
    optional = "None" in note or "Optional" in note
    if default is None:
        kind = next((v for k, v in _SCALARS.items() if re.fullmatch(rf"{k}(\s*\|\s*None)?", note)),
                    "Tensor")
        return f"{kind}{'?' if optional else ''} {arg.arg}"
    try:
        value = ast.literal_eval(default)          # -1 and 1e-3 too, no names or calls
    except ValueError:
        return None
    if value is None:
        kind = "Tensor" if "Tensor" in note else next(
            (v for k, v in _SCALARS.items() if k in note), "float")
        return f"{kind}? {arg.arg}=None"
    kind = {bool: "bool", int: "int", float: "float"}.get(type(value))
    if kind is None:
        return None
    return f"{kind} {arg.arg}={value!r}"


# ---- the package's files ---------------------------------------------------------
def package_files(info: KernelInfo, evidence: dict[str, str]) -> dict[str, str]:
    """Returns {relative path: text} of pyproject.toml and the package directory."""
    pkg = info.names.package
    out = {"pyproject.toml": _pyproject(info)}
    for template, name in TEMPLATE_MODULES.items():
        out[f"{pkg}/{name}"] = (TEMPLATES / template).read_text()
    out[f"{pkg}/{RUNTIME_MODULE}"] = RUNTIME.read_text()
    out[f"{pkg}/{PROBLEMS_PACKAGE}/__init__.py"] = _PROBLEMS_INIT
    for name in shipped_problem_modules(None if info.meta["user_problem"] else info.problem):
        out[f"{pkg}/{PROBLEMS_PACKAGE}/{name}.py"] = (PROBLEMS / f"{name}.py").read_text()
    out[f"{pkg}/{RUNTIME_RULES.name}"] = RUNTIME_RULES.read_text()
    out[f"{pkg}/kernel.json"] = json.dumps(info.meta, indent=2) + "\n"
    for name, text in info.files.files:
        out[f"{pkg}/kernel/{name}"] = text
    for name, text in evidence.items():
        out[f"{pkg}/evidence/{name}"] = text
    return out


def shipped_problem_modules(problem: str | None) -> list[str]:
    """Returns the modules of evoattn/problems/ a package ships: those the templates import,
    the problem's own (and its OP_MODULE), and every module they import from there in turn."""
    todo = [name for template in TEMPLATE_MODULES if template.endswith(".py")
            for name in _imports(TEMPLATES / template, PROBLEMS_PACKAGE)]
    if problem in problem_modules.builtin_names():
        module = problem_modules.module_of(problem)
        todo += [module_name(problem),
                 *([module.OP_MODULE] if hasattr(module, "OP_MODULE") else [])]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += _imports(PROBLEMS / f"{name}.py", "")
    return sorted(seen)


def module_name(problem: str) -> str:
    """Returns the file name (no .py) of a built-in problem's module ("model": model_prefill)."""
    return problem_modules.module_of(problem).__name__.rsplit(".", 1)[1]


@functools.lru_cache(maxsize=None)
def _imports(path: Path, package: str) -> tuple[str, ...]:
    """Returns the problem modules `path` imports from its sibling package `package` ("": from
    its own), anywhere in its text (function bodies too): `from .<package>.x import ...` or
    `from .<package> import x`."""
    prefix = package.split(".") if package else []
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or node.level != 1:
            continue
        parts = node.module.split(".") if node.module else []
        if parts[:len(prefix)] == prefix:
            rest = parts[len(prefix):]
            found += rest[:1] if rest else [a.name for a in node.names]
    return tuple(n for n in found if (PROBLEMS / f"{n}.py").is_file())


def _pyproject(info: KernelInfo) -> str:
    uses_triton = any(re.search(r"^\s*(import|from)\s+triton\b", text, re.M)
                      for name, text in info.files.files if name.endswith(".py"))
    # ninja: torch.utils.cpp_extension builds the C++ call path with it (see _native.py)
    deps = ['"torch>=2.5"', '"ninja"'] + (['"triton>=3.2"'] if uses_triton else [])
    template = string.Template((TEMPLATES / "pyproject.toml.in").read_text())
    return template.substitute(dist=info.names.dist, package=info.names.package,
                               problem=info.problem, program_id=info.meta["program_id"],
                               dependencies=", ".join(deps))
