"""The `evoattn` command: a thin layer over the library; every tool error is one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from evaluator.types import EXIT_USAGE, exit_code_for

from . import report
from .errors import EvoattnError, UsageError
from .problems import load_problem
from .sandbox import resolve_device

console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True, highlight=False)


def _die(e: Exception, code: int = 1) -> None:
    err_console.print(f"[red]{type(e).__name__}[/red]: {e}", soft_wrap=True)
    sys.exit(code)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UsageError as e:
            _die(e, EXIT_USAGE)
        except EvoattnError as e:
            _die(e, 1)
        except OSError as e:    # an unwritable --output or --out, a full disk: one line too
            _die(e, 1)


@click.group(cls=_Group)
@click.version_option(package_name="evoattn")
def main() -> None:
    """Evolve fast CUDA and Triton attention kernels, checked and timed against PyTorch SDPA."""


def _problem_ref(name: str) -> str:
    """Returns a built-in name as is, or a problem .py path made absolute (for the child)."""
    return str(Path(name).resolve()) if name.endswith(".py") else name


def _configs(problem: Any, spec: str | None) -> tuple[dict[str, Any], ...] | None:
    if not spec:
        return None
    try:
        return tuple(problem.parse_configs(spec))
    except ValueError as e:
        raise UsageError(f"--configs: {e}") from None


@main.command("eval")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--problem", default="sdpa", show_default=True, help="built-in name or problem .py")
@click.option("--configs", help="'B,H,S,D[,causal|nc];...' (default: the problem's configs)")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]))
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto",
              show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write the result")
@click.option("--trials", type=int, default=3, show_default=True)
@click.option("--reps", type=int, help="timed repetitions per config")
@click.option("--warmup", type=int, help="untimed calls per config before timing")
@click.option("--policy", type=click.Choice(["kernel-only", "allow-library"]),
              default="kernel-only", show_default=True)
@click.option("--max-abs", type=float, help="fixed absolute tolerance instead of the relative rule")
@click.option("--tolerance-factor", type=float, help="factor x torch's own error (default 2)")
@click.option("--all-backends", is_flag=True, help="also time every SDPA backend")
@click.option("--no-screen", is_flag=True, help="check every config even after one fails")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="run limit, s")
@click.option("--set", "knob_sets", multiple=True, metavar="NAME=VALUE",
              help="evaluate with this knob (a `# evoattn: choice(...)` line) set; repeatable")
def eval_cmd(path: str, problem: str, configs: str | None, dtype: str | None, device: str,
             json_path: str | None, trials: int, reps: int | None, warmup: int | None,
             policy: str,
             max_abs: float | None, tolerance_factor: float | None, all_backends: bool,
             no_screen: bool, timeout: float, knob_sets: tuple[str, ...]) -> None:
    """Check one kernel file against the reference and time it against SDPA."""
    from .sandbox import EvalSettings, SubprocessEvaluator
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{path}: file not found")
    if p.suffix not in (".py", ".cu"):
        raise UsageError(f"{path}: expected a .py (Python/Triton) or .cu (CUDA) file")
    prob = load_problem(problem)
    dev = resolve_device(device)
    if p.suffix == ".cu" and dev == "cpu":
        console.print("[yellow]no GPU[/yellow]: a .cu candidate is only compiled here, not run")
    if trials < 1:
        raise UsageError("--trials must be >= 1")
    source = _with_knobs(p, p.read_text(), knob_sets)
    tol: dict[str, Any] = {}
    if max_abs is not None:
        tol["max_abs"] = max_abs
    if tolerance_factor is not None:
        tol["factor"] = tolerance_factor
    settings = EvalSettings(problem=_problem_ref(problem), configs=_configs(prob, configs),
                            dtype=dtype, device=dev, trials=trials, reps=reps, warmup=warmup,
                            tolerance=tol, policy=policy, all_backends=all_backends,
                            run_timeout_s=timeout, screen=not no_screen)
    if dev == "cpu":
        console.print("[yellow]CPU mode[/yellow]: Triton runs in its interpreter; "
                      "timings are CPU timings, not GPU performance.")
    with console.status(f"evaluating {p.name} on {dev} ..."):
        name = p.name + (f" [{', '.join(knob_sets)}]" if knob_sets else "")
        result = SubprocessEvaluator(settings).evaluate(source, p.suffix, name)
    report.print_eval(console, result)
    if json_path:
        _write_json_atomic(Path(json_path), result.to_json())
    sys.exit(exit_code_for(result.verdict))


def _with_knobs(path: Path, source: str, knob_sets: tuple[str, ...]) -> str:
    """Returns the source with each NAME=VALUE knob set; a bad name or value is a UsageError."""
    from .mutators.knobs import parse_settings, set_knobs
    if not knob_sets:
        return source
    try:
        return set_knobs(source, parse_settings(str(path), source, knob_sets))
    except ValueError as e:
        raise UsageError(str(e)) from None


@main.command()
@click.option("--problem", default="sdpa", show_default=True)
@click.option("--configs", help="'B,H,S,D[,causal|nc];...'")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]))
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto")
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
def baseline(problem: str, configs: str | None, dtype: str | None, device: str,
             json_path: str | None) -> None:
    """Time every PyTorch implementation (SDPA backends, naive) per config."""
    prob = load_problem(problem)
    cfgs = _configs(prob, configs)
    dev = resolve_device(device)
    req = {"problem": _problem_ref(problem), "configs": list(cfgs) if cfgs else None,
           "dtype": dtype, "device": dev}
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    with console.status("timing PyTorch baselines ..."):
        proc = subprocess.run([sys.executable, "-m", "evaluator.baseline"], input=json.dumps(req),
                              capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not proc.stdout.strip():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EvoattnError(f"baseline run failed: {tail}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    console.print(report.baseline_table(data["rows"], data["device"]))
    if json_path:
        _write_json_atomic(Path(json_path), data)


@main.command()
@click.argument("paths", nargs=-1, type=click.Path(dir_okay=False))
def problems(paths: tuple[str, ...]) -> None:
    """List the built-in problems (and any problem .py files given) with their contracts."""
    from evaluator.problems import builtin_names
    for name in list(builtin_names()) + list(paths):
        p = load_problem(name)
        console.print(f"[bold]{p.name}[/bold] — {p.summary}")
        console.print(f"  contract: {p.contract}")
        if p.cuda_symbol:
            console.print("  CUDA fast form:\n    " + p.cuda_signature.replace("\n", "\n    "))
        console.print(f"  domain: {p.domain}")
        console.print(f"  dtypes: {', '.join(p.dtypes)} (default {p.default_dtype})")
        console.print("  configs: " + "; ".join(p.label(c) for c in p.default_configs))
        console.print(f"  baseline: {p.baseline_name}\n")
    console.print("user-defined problems: pass a problem .py file as --problem "
                  "(see examples/README.md)")


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="run YAML (default: configs/default.yaml)")
@click.option("--iterations", type=int, help="override the config's iterations")
@click.option("--output", help="override the run directory")
@click.option("--seed", "random_seed", type=int, help="override the random seed")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]))
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False),
              help="continue the run in this directory")
@click.option("--max-wall-s", type=float, help="stop after this many seconds (wall time)")
@click.option("--quiet", is_flag=True, help="log lines instead of the live view")
def run(config_path: str | None, iterations: int | None, output: str | None,
        random_seed: int | None, device: str | None, resume_dir: str | None,
        max_wall_s: float | None, quiet: bool) -> None:
    """Evolve kernels from a seed program (the main job)."""
    from .runner import start_run
    start_run(config_path=config_path, iterations=iterations, output=output,
              random_seed=random_seed, device=device, resume_dir=resume_dir, quiet=quiet,
              console=console, max_wall_s=max_wall_s)


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False))
def export(run_dir: str, out_dir: str) -> None:
    """Export a run's best kernel, its evaluation, lineage and leaderboard."""
    from .export import export_run
    if not Path(run_dir, "run.sqlite").is_file():
        raise UsageError(f"{run_dir}: not a run directory (no run.sqlite)")
    summary = export_run(run_dir, out_dir)
    console.print(f"exported to {out_dir}:")
    for f in sorted(Path(out_dir).iterdir()):
        console.print(f"  {f.name}")
    del summary


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
