"""Wires a run together from its config: store, evaluator, mutators, view; then searches."""
from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from typing import Any

from rich.console import Console

from .config import RunConfig, check_config, config_from_dict, config_to_dict, load_config
from .errors import EvoattnError, RunDirError, UsageError
from .problems import load_problem
from .report import cost_summary, label
from .sandbox import EvalSettings, SubprocessEvaluator, detect_target, resolve_device

DEFAULT_CONFIG = "configs/default.yaml"
# Keys that may differ when a run is resumed (everything else must match the stored config).
_RESUMABLE = {"iterations", "output", "max_wall_s", "target_fitness"}


def start_run(*, config_path: str | None, iterations: int | None, output: str | None,
              random_seed: int | None, device: str | None, resume_dir: str | None, quiet: bool,
              console: Console, max_wall_s: float | None = None) -> None:
    """Runs (or resumes) a search and exports its best kernel into RUN_DIR/best."""
    from .store import RunStore
    cfg, resuming = _resolve_config(config_path, resume_dir, iterations, output, random_seed,
                                    device)
    if max_wall_s is not None:
        cfg = dataclasses.replace(cfg, max_wall_s=max_wall_s)
    dev = resolve_device(cfg.device)
    cfg = dataclasses.replace(cfg, device=dev)
    problem_ref = _problem_ref(cfg.problem, config_path)
    problem = _problem(problem_ref)
    seed_path = _find(cfg.seed, config_path)
    if seed_path.suffix == ".cu" and dev == "cpu":
        raise UsageError(f"{seed_path}: a CUDA seed needs a GPU; use a .py seed with device: cpu")
    configs = _parse_configs(problem, cfg)
    run_dir = Path(resume_dir or cfg.output)
    store = RunStore.open(run_dir, config_to_dict(cfg), create=not resuming)
    try:
        if resuming:
            was = store.stored_config().get("device")
            if was != dev:   # CPU and GPU speedups must not compete in one population
                raise RunDirError(f"{run_dir}: this run was timed on {was}; it cannot "
                                  f"continue on {dev} (use --device {was}, or a new --output)")
            store.record_stop(None)
        _search(cfg, store, problem, problem_ref, configs, seed_path, dev, quiet, console,
                run_dir)
    finally:
        store.close()


def _search(cfg: RunConfig, store: Any, problem: Any, problem_ref: str, configs: Any,
            seed_path: Path, dev: str, quiet: bool, console: Console, run_dir: Path) -> None:
    from .export import export_run
    from .mutators.knobs import KnobMutator
    from .progress import EventLog, LiveView
    from .search import Search

    ev = cfg.evaluator
    on_cpu = dev == "cpu"
    settings = EvalSettings(
        problem=problem_ref, configs=configs, dtype=cfg.dtype, device=dev, trials=ev.trials,
        warmup=1 if on_cpu else ev.warmup, reps=min(ev.reps, 3) if on_cpu else ev.reps,
        tolerance={"factor": ev.tolerance_factor, "floor": ev.tolerance_floor,
                   **({"max_abs": ev.max_abs} if ev.max_abs is not None else {})},
        policy=ev.policy, all_backends=ev.all_backends, build_timeout_s=ev.build_timeout_s,
        run_timeout_s=ev.run_timeout_s, screen=ev.screen,
        secret_env_names=tuple(m.api_key_env for m in cfg.llm.models))
    evaluator = SubprocessEvaluator(settings)
    meter = None
    mutators: list[tuple[Any, float]] = []
    target = detect_target(dev)   # the @target fact: lets knob conditions rule out dead code
    for m in cfg.mutators:
        if m.kind == "knobs":     # every evaluated program is committed before the next proposal
            mutators.append((KnobMutator(cfg.population.crossover_rate,
                                         is_known=store.has_program,
                                         facts={"target": target} if target else None),
                             m.weight))
        else:
            from .mutators.llm import CostMeter, LlmMutator
            if meter is None:     # a resumed run keeps counting its earlier calls and spend
                meter = CostMeter(cfg.llm.budget_usd)
                t = store.llm_totals()
                meter.carry_over(t.calls, t.prompt_tokens, t.completion_tokens, t.cost_usd)
            mutators.append((LlmMutator(cfg.llm, meter), m.weight))
    events = EventLog(run_dir / "events.jsonl")

    def llm_totals() -> dict[str, float]:
        if meter is None:
            return {}
        return {"calls": meter.calls, "prompt_tokens": meter.prompt_tokens,
                "completion_tokens": meter.completion_tokens, "cost_usd": meter.spent_usd}

    if on_cpu:
        console.print("[yellow]CPU mode[/yellow]: no GPU here, so candidates run through "
                      "Triton's interpreter on small configs; speedups are CPU timings, "
                      "not GPU performance.")
    view = LiveView(console, quiet, events, dev)
    search = Search(cfg, store, evaluator, mutators, seed_path.read_text(), seed_path.suffix,
                    contract=problem.contract, on_progress=view.update,
                    budget_exhausted=lambda: bool(meter and meter.exhausted),
                    llm_totals=llm_totals,
                    lookahead=cfg.llm.concurrency if meter is not None else 0)
    events.write("start", config=config_to_dict(cfg), device=dev, run_dir=str(run_dir))
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with view:
            outcome = search.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        evaluator.close()                       # stops the zygote
    events.write("stop", reason=outcome.stop_reason, iterations=outcome.iterations_done,
                 best_id=outcome.best.id if outcome.best else None,
                 best_fitness=outcome.best.fitness if outcome.best else None,
                 elapsed_s=outcome.elapsed_s)
    events.close()
    _summary(console, outcome, search)
    if outcome.best is None:
        raise EvoattnError(f"no correct program, nothing exported ({outcome.stop_reason})")
    export_run(store, run_dir / "best")
    extra = "" if problem_ref == "sdpa" else f" --problem {problem_ref}"
    extra += f" --device {dev}" if dev == "cpu" else ""
    if configs:
        extra += " --configs '" + ";".join(_config_spec(c) for c in configs) + "'"
    console.print(f"best kernel exported to {run_dir / 'best'} (re-check it with "
                  f"`evoattn eval {run_dir / 'best'}/best{outcome.best.suffix}{extra}`)")


def _summary(console: Console, outcome: Any, search: Any) -> None:
    seed, best = outcome.seed, outcome.best
    console.print(f"stopped after iteration {outcome.iterations_done}: {outcome.stop_reason}")
    console.print(f"seed fitness {seed.fitness:.4f} -> best fitness "
                  f"{best.fitness if best else 0.0:.4f} ({best.id if best else '-'}) in "
                  f"{outcome.elapsed_s:.0f} s")
    if best and best.result and seed.result:
        by_cfg = {str(c.params): c.speedup for c in seed.result.configs}
        for c in best.result.configs:
            before = by_cfg.get(str(c.params))
            console.print(f"  {label(c.params)}: {before or 0:.3f}x -> {c.speedup or 0:.3f}x "
                          f"vs {best.result.baseline}")
    cost = cost_summary([p.result for p in search.programs.values() if p.result is not None])
    if cost:
        console.print(cost)


def _config_spec(cfg: dict[str, Any]) -> str:
    """Returns the `--configs` text for one config."""
    if set(cfg) == {"B", "H", "S", "D", "causal"}:
        return f"{cfg['B']},{cfg['H']},{cfg['S']},{cfg['D']},{'causal' if cfg['causal'] else 'nc'}"
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _stored_config(run_dir: str) -> RunConfig:
    """Returns the config a run directory was started with (RunDirError if it holds no run)."""
    from .store import RunStore
    st = RunStore.open_readonly(run_dir)
    try:
        return config_from_dict(st.stored_config(), f"{run_dir}/run.sqlite")
    finally:
        st.close()


def _resolve_config(config_path: str | None, resume_dir: str | None, iterations: int | None,
                    output: str | None, random_seed: int | None,
                    device: str | None) -> tuple[RunConfig, bool]:
    resuming = False
    if resume_dir and (config_path or output):
        raise UsageError("--resume continues a run with its stored config; "
                         "it takes no --config or --output")
    if resume_dir:
        cfg = _stored_config(resume_dir)
        resuming = True
        cfg = dataclasses.replace(cfg, output=resume_dir)
    else:
        path = config_path or DEFAULT_CONFIG
        # Stored with absolute seed and problem paths, so --resume works from any directory.
        cfg = _absolute_paths(load_config(path), path)
    over: dict[str, Any] = {}
    if iterations is not None:
        over["iterations"] = iterations
    if output is not None:
        over["output"] = output
    if random_seed is not None:
        if resuming:
            raise UsageError("--seed cannot change when resuming a run")
        over["random_seed"] = random_seed
    if device is not None:
        over["device"] = device
    cfg = dataclasses.replace(cfg, **over)
    check_config(cfg, "command line")
    if not resuming and (Path(cfg.output) / "run.sqlite").is_file():
        # Re-running with the same output continues the run if the config matches.
        stored = _stored_config(cfg.output)
        if not Path(stored.seed).is_absolute():   # a run stored before paths were absolute
            stored = _absolute_paths(stored, path)
        a = {k: v for k, v in config_to_dict(stored).items() if k not in _RESUMABLE | {"device"}}
        b = {k: v for k, v in config_to_dict(cfg).items() if k not in _RESUMABLE | {"device"}}
        if a != b:
            diff = sorted(k for k in a if a[k] != b.get(k))
            raise RunDirError(f"{cfg.output}: holds a run with a different config "
                              f"(differs in: {', '.join(diff)}); use another --output")
        resuming = True
    return cfg, resuming


def _problem(name: str) -> Any:
    return load_problem(name, where="problem: ")


def _locate(path: str, config_path: str | None, what: str) -> Path:
    """Returns an existing file: the path itself, else relative to the config's dir or its parent."""
    p = Path(path)
    candidates = [p] if p.is_absolute() else [Path.cwd() / p]
    if config_path and not p.is_absolute():
        here = Path(config_path).resolve().parent
        candidates += [here / p, here.parent / p]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise UsageError(f"{what} {path} not found" +
                     (f" (config {config_path})" if config_path else ""))


def _absolute_paths(cfg: RunConfig, config_path: str) -> RunConfig:
    """Returns cfg with its seed and problem file found relative to the config, made absolute."""
    return dataclasses.replace(cfg, seed=str(_find(cfg.seed, config_path)),
                               problem=_problem_ref(cfg.problem, config_path))


def _problem_ref(name: str, config_path: str | None) -> str:
    """Returns a built-in name as is, or a problem .py path made absolute.

    The evaluator's child runs in a temporary directory, so it must get an absolute path.
    """
    if not name.endswith(".py"):
        return name
    return str(_locate(name, config_path, "problem file"))


def _find(path: str, config_path: str | None) -> Path:
    found = _locate(path, config_path, "seed program")
    if found.suffix not in (".py", ".cu"):
        raise UsageError(f"{found}: seed must be a .py or .cu file")
    return found


def _parse_configs(problem: Any, cfg: RunConfig) -> tuple[dict[str, Any], ...] | None:
    if not cfg.configs:
        return None
    out: list[dict[str, Any]] = []
    for i, spec in enumerate(cfg.configs):
        try:
            out += problem.parse_configs(spec)
        except ValueError as e:
            raise UsageError(f"configs[{i}]: {e}") from None
    return tuple(out)


__all__ = ["start_run"]
