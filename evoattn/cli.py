"""The `evoattn` command: a thin layer over the library; every tool error is one line.

Exit codes (README): 0 correct, 1 incorrect or an integrity verdict (and tool errors that are
not the user's input), 2 build/load error, 3 timeout/crash/oom, 4 bad usage, 5 evaluator fault,
6 compiled only (no GPU), 130 Ctrl-C (128 + the signal for SIGTERM, SIGHUP).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from evoattn.contract import program
from evoattn.contract.request import DTYPES, TIMING_MODES
from evoattn.contract.types import EXIT_OK, EXIT_USAGE, exit_code_for

from . import report, settings
from .errors import EvoattnError, Interrupted, RunDirError, UsageError

# Into a file or a pipe, lines print whole (soft wrap): a command in a hint must stay one line
# to be copied; a terminal wraps what it shows itself.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 200,
                  soft_wrap=not sys.stdout.isatty())
err_console = Console(stderr=True, highlight=False, soft_wrap=not sys.stderr.isatty())
DEVICES = ["auto", "cuda", "cpu"]
_DEVICE_HELP = "where to run: cuda, cpu (Triton's interpreter), or auto (cuda if there is a GPU)"


def _die(name: str, message: str, code: int) -> None:
    # escape: a message is plain text ('".[report]"' is not a style tag)
    err_console.print(f"[red]{name}[/red]: {escape(message)}", soft_wrap=True)
    sys.exit(code)


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


class _Cli(click.Group):
    """The command group: every way a command can end becomes one line and an exit code."""

    def main(self, args: Any = None, prog_name: str | None = None,  # type: ignore[override]
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise_interrupted)
        sys.exit(_run(lambda: super(_Cli, self).main(args, prog_name, complete_var, False,
                                                     **extra)))


def _run(command: Any) -> int:
    try:
        code = command()
    except click.exceptions.Exit as e:
        code = e.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt) as e:   # Abort: click's wrapping of one
        signum = getattr(e, "signum", None) or getattr(e.__cause__, "signum", signal.SIGINT)
        err_console.print("interrupted: every evaluation process was stopped")
        code = 128 + signum
    except click.ClickException as e:      # click's own usage errors: a missing option, say
        _die("UsageError", e.format_message(), EXIT_USAGE)
    except (UsageError, RunDirError) as e:
        _die(type(e).__name__, str(e), EXIT_USAGE)
    except SystemExit as e:
        code = e.code
    except EvoattnError as e:
        _die(type(e).__name__, str(e), 1)
    except OSError as e:    # an unwritable --output or --out, a full disk: one line too
        _die(type(e).__name__, str(e), 1)
    return code if isinstance(code, int) else 0


@click.group(cls=_Cli)
@click.version_option(package_name="evoattn")
def cli() -> None:
    """Evolve fast CUDA and Triton attention kernels, checked and timed against PyTorch."""


def main() -> None:
    """The console entry point (`evoattn`)."""
    cli.main()


@cli.command("eval")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--problem", default="sdpa", show_default=True, help="built-in name or problem .py")
@click.option("--configs", help="'B,H,S,D[,causal|nc];...' (default: the problem's configs)")
@click.option("--dtype", "dtypes", type=click.Choice(DTYPES), multiple=True,
              help="check in this dtype; repeatable: correct only if correct in each, timed "
                   "in the first (default: the problem's default dtype)")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help=_DEVICE_HELP)
@click.option("--timing", type=click.Choice(TIMING_MODES),
              help="the time fitness uses (default: call, what a model's eager loop pays)")
@click.option("--baseline", help="the baseline fitness uses: 'best' (default) or a name")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write the result")
@click.option("--trials", type=int, help="fresh input sets per config (default 3)")
@click.option("--reps", type=int, help="the most rounds of the fitness mode per config (rounds "
              "come in pairs: an odd number is rounded up)")
@click.option("--warmup", type=int, help="untimed calls per config before timing")
@click.option("--policy", type=click.Choice(["kernel-only", "allow-library"]),
              help="kernel-only (default): library attention (PyTorch's SDPA, "
                   "flash-attn, ...) is refused; allow-library permits it")
@click.option("--max-abs", type=float, help="fixed absolute tolerance instead of the relative rule")
@click.option("--tolerance-factor", type=float, help="factor x torch's own error (default: "
              "the problem's, 2 for the built-in ones)")
@click.option("--all-backends", is_flag=True,
              help="also time every SDPA backend and a naive implementation")
@click.option("--no-screen", is_flag=True, help="check every config even after one fails")
@click.option("--timeout", type=float, help="run-stage limit in seconds (default 600)")
@click.option("--set", "knob_sets", multiple=True, metavar="NAME=VALUE",
              help="evaluate with this knob (a `# evoattn: choice(...)` line) set; repeatable")
@click.option("--rival", type=click.Path(dir_okay=False),
              help="another kernel file, checked and timed beside PATH in the same rounds: "
                   "prints both fitnesses and the gain with its 95% interval")
@click.option("--pin-cpu/--no-pin-cpu", default=None,
              help="time on the fastest CPU, pinned (default on; GPU only)")
def eval_cmd(path: str, problem: str, configs: str | None, dtypes: tuple[str, ...], device: str,
             timing: str | None, baseline: str | None, json_path: str | None,
             trials: int | None, reps: int | None, warmup: int | None, policy: str | None,
             max_abs: float | None, tolerance_factor: float | None,
             all_backends: bool, no_screen: bool, timeout: float | None,
             knob_sets: tuple[str, ...], rival: str | None, pin_cpu: bool | None) -> None:
    """Check one kernel file against the reference and time it against PyTorch's baselines."""
    from .sandbox import SubprocessEvaluator
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{path}: file not found")
    if p.suffix not in (".py", ".cu"):
        raise UsageError(f"{path}: expected a .py (Python/Triton) or .cu (CUDA) file")
    ref = settings.problem_ref(problem)
    prob = settings.problem(ref)
    dev = settings.resolve_device(device)
    ev = settings.evaluator_config(
        trials=trials, reps=reps, warmup=warmup, policy=policy, max_abs=max_abs,
        tolerance_factor=tolerance_factor, all_backends=all_backends or None,
        screen=False if no_screen else None, run_timeout_s=timeout, timing=timing,
        baseline=baseline, pin_cpu=pin_cpu)
    request = settings.eval_request(ref, prob, dev, settings.parse_configs(prob, configs,
                                                                           "--configs"),
                                    dtypes, ev)
    if settings.cuda_on_cpu(p, dev):
        console.print("[yellow]no GPU[/yellow]: a .cu candidate is only compiled here, not run")
    elif dev == "cpu":
        settings.cpu_notice(console)
    try:
        source = _with_knobs(p, program.read(p), knob_sets)
        rival_source = None
        if rival is not None:
            if not Path(rival).is_file():
                raise UsageError(f"{rival}: file not found (--rival)")
            if Path(rival).suffix != p.suffix:
                raise UsageError(f"{rival}: --rival must be a {p.suffix} file like {p.name}")
            rival_source = program.read(Path(rival))
    except program.ProgramError as e:
        raise UsageError(str(e)) from None
    evaluator = SubprocessEvaluator(request)
    try:
        with console.status(f"evaluating {p.name} on {dev} ..."):
            name = p.name + (f" [{', '.join(knob_sets)}]" if knob_sets else "")
            result = evaluator.evaluate(source, p.suffix, name, rival_source)
    finally:
        evaluator.close()
    result = report.in_user_terms(result, str(p), rival)
    report.print_eval(console, result, prob.flops)
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


@cli.command()
@click.option("--problem", default="sdpa", show_default=True, help="built-in name or problem .py")
@click.option("--configs", help="'B,H,S,D[,causal|nc];...' (default: the problem's configs)")
@click.option("--dtype", type=click.Choice(DTYPES),
              help="time in this dtype (default: the problem's default dtype)")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help=_DEVICE_HELP)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write the timings")
def baseline(problem: str, configs: str | None, dtype: str | None, device: str,
             json_path: str | None) -> None:
    """Time every baseline and PyTorch backend of a problem, per config, in every mode."""
    ref = settings.problem_ref(problem)
    prob = settings.problem(ref)
    cfgs = settings.parse_configs(prob, configs, "--configs")
    dev = settings.resolve_device(device)
    req = {"problem": ref, "configs": list(cfgs) if cfgs else None, "dtype": dtype,
           "device": dev}
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    if dev == "cpu":
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    with console.status("timing PyTorch baselines ..."):
        proc = subprocess.run([sys.executable, "-m", "evoattn.child.baseline"], input=json.dumps(req),
                              capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not proc.stdout.strip():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EvoattnError(f"baseline run failed: {tail}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    console.print(report.baseline_table(data["rows"], data["device"]))
    if json_path:
        _write_json_atomic(Path(json_path), data)


@cli.command()
@click.argument("paths", nargs=-1, type=click.Path(dir_okay=False))
def problems(paths: tuple[str, ...]) -> None:
    """List the built-in problems (and any problem .py files given) with their contracts."""
    from evoattn.problems import builtin_names
    for name in list(builtin_names()) + list(paths):
        p = settings.problem(settings.problem_ref(name) if name.endswith(".py") else name)
        console.print(report.problem_text(p))
    console.print("user-defined problems: pass a problem .py file as --problem "
                  "(see examples/README.md)")


@cli.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="run YAML (default: configs/default.yaml)")
@click.option("--iterations", type=int, help="override the config's iterations")
@click.option("--output", help="override the run directory")
@click.option("--random-seed", type=int,
              help="override the config's random_seed (the search's RNG; the seed program is "
                   "the config's seed:)")
@click.option("--seed", "old_seed", hidden=True,
              help="deprecated spelling of --random-seed")
@click.option("--device", type=click.Choice(DEVICES),
              help=_DEVICE_HELP + " (default: the config's device)")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False),
              help="continue the run in this directory")
@click.option("--max-wall-s", type=float,
              help="end the run by about this many seconds (wall time), its end-of-run duels "
                   "(setting back, re-measuring the best) included")
@click.option("--quiet", is_flag=True, help="log lines instead of the live view")
@click.option("--model", "model_spec", metavar="CONFIG",
              help="a Hugging Face config.json or model type (gemma2, gpt_oss, mistral, llama, "
                   "...): run the model problem at that model's attention configs "
                   "(default --config: configs/model.yaml)")
@click.option("--phase", type=click.Choice(["prefill", "decode"]), default="prefill",
              show_default=True, help="with --model: the prompt's attention (the model problem) "
              "or a generation step's over a cache (model_decode; default --config: "
              "configs/model_decode.yaml)")
def run(config_path: str | None, iterations: int | None, output: str | None,
        random_seed: int | None, old_seed: str | None, device: str | None,
        resume_dir: str | None, max_wall_s: float | None, quiet: bool,
        model_spec: str | None, phase: str) -> None:
    """Evolve kernels from a seed program (the main job)."""
    from .runner import start_run
    if old_seed is not None:
        random_seed = _old_seed(old_seed, random_seed)
    overrides = None
    if model_spec is not None:
        from .model_configs import MODEL_RUN_CONFIG, run_overrides
        if resume_dir:
            raise UsageError("--resume continues a run with its stored configs; it takes no "
                             "--model")
        config_path = config_path or MODEL_RUN_CONFIG[phase]
        overrides, derived = run_overrides(model_spec, config_path, device, phase)
        console.print(derived)
    sys.exit(start_run(config_path=config_path, iterations=iterations, output=output,
                       random_seed=random_seed, device=device, resume_dir=resume_dir,
                       quiet=quiet, console=console, max_wall_s=max_wall_s,
                       overrides=overrides))


def _old_seed(value: str, random_seed: int | None) -> int:
    """Returns the random seed `--seed` gave (its old name); a path there is a UsageError."""
    if random_seed is not None:
        raise UsageError("--seed is the old name of --random-seed: give only --random-seed")
    try:
        seed = int(value)
    except ValueError:
        raise UsageError(f"--seed {value}: --seed is the random seed; use --random-seed N for "
                         "the RNG, and seed: in the config for the seed program") from None
    err_console.print("--seed is deprecated: use --random-seed")
    return seed


@cli.command("bench-model")
@click.argument("package")
@click.option("--model", "model_spec", required=True, metavar="CONFIG",
              help="a Hugging Face config.json or model type (random weights)")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="cuda (bfloat16) or cpu (float32, a tiny model: the package falls back)")
@click.option("--shape", "shapes", multiple=True, metavar="B,S",
              help="a prefill to time; repeatable (default: 1,8192 and 4,2048)")
@click.option("--generate", "gen", metavar="B,PROMPT,NEW",
              help="greedy generation to time (default 8,4096,128; NEW 0: none)")
@click.option("--impl", "impls", multiple=True, type=click.Choice(["eager", "sdpa",
              "flex_attention"]), help="built-ins to compare (default: every one the model "
              "supports); repeatable")
@click.option("--layers", type=int, help="cut the model to this many layers")
@click.option("--rounds", type=int, default=5, show_default=True, help="timed rounds")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write the result")
def bench_model(package: str, model_spec: str, device: str, shapes: tuple[str, ...],
                gen: str | None, impls: tuple[str, ...], layers: int | None, rounds: int,
                json_path: str | None) -> None:
    """Time an exported package's attention in a Hugging Face model against the model's
    built-in implementations and a null attention: attention's share, the op speedup, the
    Amdahl prediction beside the measured gain, and accuracy against float32."""
    from . import bench_model as bm
    st = bm.settings_from(shapes, gen, rounds, impls, layers)
    dev = settings.resolve_device(device)
    pkg = bm.load_package(package)
    model = bm.build_model(model_spec, dev, layers)
    with console.status(f"timing {model_spec} on {dev} ..."):
        result = bm.measure(model, pkg, pkg.hf.register(), model_spec, dev, st)
    console.print(bm.table(result))
    console.print(bm.accuracy_table(result))
    if json_path:
        _write_json_atomic(Path(json_path), bm.to_json(result))


@cli.group()
def llm() -> None:
    """Check the LLM endpoints a run config names, before a run spends on them."""


@llm.command("check")
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="the run YAML whose llm: section names the models")
def llm_check(config_path: str | None) -> None:
    """Send one short request to each model of a config's llm: section: answer, latency,
    context length, price. Without a config or an llm: section there is nothing to check
    (exit 0)."""
    from .config import load_llm_section
    from .mutators.check import check, render
    from .runner import seed_prompt_chars
    if config_path is None:
        console.print("nothing to check: no --config given (`evoattn llm check --config C.yaml` "
                      "asks each model of C's llm: section)")
        sys.exit(EXIT_OK)
    section = load_llm_section(config_path)
    if section is None or not section.models:
        console.print(f"nothing to check: {config_path} has "
                      + ("no llm: section" if section is None else "no llm.models"))
        sys.exit(EXIT_OK)
    with console.status(f"asking {len(section.models)} model(s) ..."):
        checks = check(section)
    render(console, checks, seed_prompt_chars(config_path), section)
    sys.exit(EXIT_OK if all(c.ok for c in checks) else 1)


@cli.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="where to write the export (default: RUN_DIR/best)")
def export(run_dir: str, out_dir: str | None) -> None:
    """Export a run's best kernel, its evaluation, lineage and leaderboard."""
    from .export import export_run
    if not Path(run_dir, "run.sqlite").is_file():
        raise UsageError(f"{run_dir}: not a run directory (no run.sqlite)")
    target = Path(out_dir) if out_dir else Path(run_dir) / "best"
    summary = export_run(run_dir, target)
    console.print(f"exported to {target}:")
    for f in sorted(target.iterdir()):
        console.print(f"  {f.name}")
    console.print(f"install it with `pip install {target}`, then `import {summary.package}`")


@cli.command("new-kernel")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--problem", default="sdpa", show_default=True,
              help="the problem whose entry the file defines")
@click.option("--form", type=click.Choice(["cu", "py"]),
              help="cu: CUDA fast form (entry, launcher, dtype dispatch); py: Python "
                   "(default: PATH's suffix)")
def new_kernel(path: str, problem: str, form: str | None) -> None:
    """Write a kernel file ready to fill: the entry, launcher and dtype dispatch around a simple
    correct body, which you replace with your kernel's. Never overwrites a file."""
    from .skeleton import write_skeleton
    written = write_skeleton(Path(path), problem, form)
    flag = "" if problem == "sdpa" else f" --problem {problem}"
    console.print(f"wrote {written}: replace the body between its '----' lines with your "
                  f"kernel's, then `evoattn eval {written}{flag}`")


@cli.command("report")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="where to write report.html and its charts (default: RUN_DIR/report)")
def report_cmd(run_dir: str, out_dir: str | None) -> None:
    """Write an HTML report of a run (finished or in progress) with PNG charts."""
    if not Path(run_dir, "run.sqlite").is_file():
        raise UsageError(f"{run_dir}: not a run directory (no run.sqlite)")
    try:
        from .html_report import write_report
    except ImportError as e:
        if (e.name or "").split(".")[0] != "matplotlib":
            raise
        raise UsageError('the report needs matplotlib: pip install -e ".[report]" in the '
                         "evoattn checkout (or pip install matplotlib)") from None
    page = write_report(run_dir, out_dir)
    console.print(f"report written: {page}")


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
