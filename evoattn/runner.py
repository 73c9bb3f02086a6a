"""Wires a run together from its config: store, evaluator, mutators, view; then searches."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from rich.console import Console

from evoattn.contract import program
from evoattn.contract.request import EvalRequest
from evoattn.contract.types import EXIT_OK

from . import settings
from .config import RunConfig, check_config, config_from_dict, config_to_dict, load_config
from .errors import EvoattnError, RunDirError, UsageError
from .report import cost_summary, host_bound, label, side_by_side_lines
from .childenv import detect_target

DEFAULT_CONFIG = "configs/default.yaml"
# Keys that may differ when a run is resumed (everything else must match the stored config):
# limits, and the LLM settings (another model is another mutator, not another search).
_RESUMABLE = {"iterations", "output", "max_wall_s", "target_fitness", "llm"}


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A run's resolved inputs: config, device, problem, configs, seed and request."""

    cfg: RunConfig
    resuming: bool
    device: str
    problem_ref: str
    problem: Any
    configs: tuple[dict[str, Any], ...] | None
    seed_path: Path
    seed_source: str
    request: EvalRequest
    run_dir: Path


def start_run(*, config_path: str | None, iterations: int | None, output: str | None,
              random_seed: int | None, device: str | None, resume_dir: str | None, quiet: bool,
              console: Console, max_wall_s: float | None = None,
              overrides: dict[str, Any] | None = None) -> int:
    """Runs (or resumes) a search, exports its best kernel into RUN_DIR/best; returns the exit
    code (130 after a clean stop on Ctrl-C). `overrides`: RunConfig keys set over the file's."""
    from .pool import make_evaluator
    from .store import RunStore
    plan = plan_run(config_path, iterations, output, random_seed, device, resume_dir, max_wall_s,
                    overrides)
    skipped = [d for d in (plan.cfg.dtypes or ()) if d not in (plan.request.dtypes or ())]
    if skipped:
        console.print(f"[yellow]CPU mode[/yellow]: {', '.join(skipped)} is checked on a GPU only "
                      "(PyTorch's CPU attention keeps P in float32 there, so its error, which "
                      "sets the tolerance, is no fair bound for a kernel); this run checks "
                      f"{', '.join(plan.request.dtypes or ())}")
    # Before the run directory: a cluster that cannot be reached leaves nothing behind.
    from .mutators.keys import key_env
    evaluator = make_evaluator(plan.cfg, plan.request,
                               tuple(filter(None, (key_env(m) for m in plan.cfg.llm.models))))
    try:
        store = RunStore.open(plan.run_dir, config_to_dict(plan.cfg), create=not plan.resuming)
    except BaseException:
        evaluator.close()
        raise
    try:
        if plan.resuming:
            was = store.stored_config().get("device")
            if was != plan.device:   # CPU and GPU speedups must not compete in one population
                raise RunDirError(f"{plan.run_dir}: this run was timed on {was}; it cannot "
                                  f"continue on {plan.device} (use --device {was}, or a new "
                                  "--output)")
            state = store.load_state()
            done = state["iteration"] if state else 0
            console.print(f"resuming the run in {plan.run_dir} after iteration {done} "
                          f"({len(store.load_programs())} programs stored)")
            _keep_llm_section(store, plan.cfg, console)
            store.record_stop(None)
        return _search(plan, store, evaluator, quiet, console)
    finally:
        store.close()
        evaluator.close()                       # stops every child process and zygote


def plan_run(config_path: str | None, iterations: int | None, output: str | None,
             random_seed: int | None, device: str | None, resume_dir: str | None,
             max_wall_s: float | None, overrides: dict[str, Any] | None = None) -> RunPlan:
    """Returns what a run needs, checked; every bad input is one UsageError/ConfigError line."""
    cfg, resuming = _resolve_config(config_path, resume_dir, iterations, output, random_seed,
                                    device, overrides)
    if max_wall_s is not None:
        cfg = dataclasses.replace(cfg, max_wall_s=max_wall_s)
    dev = settings.resolve_device(cfg.device, here=cfg.evaluator.backend == "local")
    cfg = dataclasses.replace(cfg, device=dev)
    ref = settings.problem_ref(cfg.problem, config_path)
    prob = settings.problem(ref, "problem: ")
    seed_path = _find_seed(cfg.seed, config_path)
    if settings.cuda_on_cpu(seed_path, dev):
        raise UsageError(f"{seed_path}: a CUDA seed needs a GPU; use a .py seed with "
                         "device: cpu")
    try:
        source = program.read(seed_path)
    except program.ProgramError as e:
        raise UsageError(str(e)) from None
    configs = settings.parse_configs(prob, cfg.configs, "configs")
    dtypes = settings.run_dtypes(cfg.dtypes, dev)
    request = settings.eval_request(ref, prob, dev, configs, dtypes, cfg.evaluator)
    if any(m.kind == "llm" for m in cfg.mutators):   # a key goes only where it is meant to
        from .mutators.keys import check_models
        check_models(cfg.llm.models, os.environ)
    return RunPlan(cfg, resuming, dev, ref, prob, configs, seed_path, source, request,
                   Path(resume_dir or cfg.output))


def _search(plan: RunPlan, store: Any, evaluator: Any, quiet: bool, console: Console) -> int:
    from .export import export_run
    from .mutators.history import StoreHistory
    from .mutators.knobs import KnobMutator
    from .progress import EventLog, LiveView
    from .search import Search

    cfg = plan.cfg
    meter = None
    mutators: list[tuple[Any, float]] = []
    target = detect_target(plan.device)   # the @target fact: lets knob conditions rule out code
    history = StoreHistory(plan.run_dir)
    for m in cfg.mutators:
        if m.kind == "knobs":     # every evaluated program is committed before the next proposal
            mutators.append((KnobMutator(cfg.population.crossover_rate,
                                         is_known=store.has_program,
                                         facts={"target": target} if target else None,
                                         history=history,
                                         transplant_rate=cfg.population.transplant_rate),
                             m.weight))
        else:
            from .mutators.llm import CostMeter, LlmMutator
            if meter is None:     # a resumed run keeps counting its earlier calls and spend
                meter = CostMeter(cfg.llm.budget_usd)
                t = store.llm_totals()
                meter.carry_over(t.calls, t.prompt_tokens, t.completion_tokens, t.cost_usd)
            mutators.append((LlmMutator(cfg.llm, meter, history=StoreHistory(plan.run_dir),
                                        facts={"target": target} if target else None,
                                        knobs_tuned=any(k.kind == "knobs" for k in cfg.mutators)),
                             m.weight))
    events = EventLog(plan.run_dir / "events.jsonl")

    def llm_totals() -> dict[str, float]:
        if meter is None:
            return {}
        return {"calls": meter.calls, "prompt_tokens": meter.prompt_tokens,
                "completion_tokens": meter.completion_tokens, "cost_usd": meter.spent_usd}

    if plan.device == "cpu":
        settings.cpu_notice(console)
    view = LiveView(console, quiet, events, plan.device)
    search = Search(cfg, store, evaluator, mutators, plan.seed_source, plan.seed_path.suffix,
                    contract=plan.problem.contract, on_progress=view.update,
                    budget_exhausted=lambda: bool(meter and meter.exhausted),
                    llm_totals=llm_totals,
                    lookahead=cfg.llm.concurrency if meter is not None else 0,
                    window=cfg.evaluator.window,
                    facts={"target": target} if target else None)
    events.write("start", config=config_to_dict(cfg), device=plan.device,
                 run_dir=str(plan.run_dir))
    with view:
        outcome = search.run()
    final = None
    if outcome.exit_code == 0 and outcome.best is not None:
        best = search.prune(outcome.best, outcome.seed, say=console.print)
        if best.id != outcome.best.id:
            events.write("pruned", best_id=best.id, before=outcome.best.id)
            outcome = dataclasses.replace(outcome, best=best)
        if not quiet:
            console.print("re-measuring the seed and the best side by side ...")
        final = search.remeasure(outcome.best, outcome.seed)
    events.write("stop", reason=outcome.stop_reason, iterations=outcome.iterations_done,
                 best_id=outcome.best.id if outcome.best else None,
                 best_fitness=outcome.best.fitness if outcome.best else None,
                 elapsed_s=outcome.elapsed_s, run_elapsed_s=outcome.run_elapsed_s)
    events.close()
    _summary(console, outcome, search, plan, final)
    if outcome.exit_code == 1:     # the LLM or the cluster stopped the run: it can go on later
        console.print(f"the run stopped ({outcome.stop_reason}); once that is fixed, rerun the "
                      f"same command (or `evoattn run --resume {plan.run_dir}`) to continue it")
    if outcome.best is None:
        raise EvoattnError(f"no correct program, nothing exported ({outcome.stop_reason})")
    exported = export_run(store, plan.run_dir / "best")
    console.print(f"best kernel exported to {plan.run_dir / 'best'}: `pip install "
                  f"{plan.run_dir / 'best'}`, then `import {exported.package}` (re-check it with "
                  f"`evoattn eval {plan.run_dir / 'best'}/best{outcome.best.suffix}"
                  f"{_eval_flags(plan)}`)")
    return outcome.exit_code if outcome.exit_code else EXIT_OK


def _eval_flags(plan: RunPlan) -> str:
    """Returns the `evoattn eval` flags that re-check the best as the run evaluated it."""
    extra = "" if plan.problem_ref == "sdpa" else f" --problem {plan.problem_ref}"
    extra += f" --device {plan.device}" if plan.device == "cpu" else ""
    extra += f" --timing {plan.request.timing}" if plan.request.timing != "call" else ""
    extra += "".join(f" --dtype {d}" for d in plan.request.dtypes or ())
    if plan.configs:
        extra += " --configs '" + ";".join(_config_spec(c) for c in plan.configs) + "'"
    return extra


def _summary(console: Console, outcome: Any, search: Any, plan: RunPlan,
             final: Any = None) -> None:
    seed, best = outcome.seed, outcome.best
    console.print(f"stopped after iteration {outcome.iterations_done}: {outcome.stop_reason}")
    whole = (f"; the whole run so far {outcome.run_elapsed_s:.0f} s"
             if outcome.run_elapsed_s > outcome.elapsed_s + 1 else "")
    mode = best.result.timing if best and best.result else ""
    mode_text = f", {mode} time" if mode else ""
    duel = final if final is not None and final.correct and final.rival_fitness else None
    # config, before, after, vs, whether the host set its call times
    rows: list[tuple[Any, float | None, float | None, str, bool]] = []
    if duel is not None:
        # The figures to believe: both re-measured side by side, after the search.
        console.print(f"seed fitness {duel.rival_fitness:.4f} -> best fitness {duel.fitness:.4f} "
                      f"({best.id}{mode_text}, re-measured side by side) in "
                      f"{outcome.elapsed_s:.0f} s (this session{whole}); during the search "
                      f"{seed.fitness:.4f} -> {best.fitness:.4f}")
        for c in duel.configs:
            before = c.speedup / c.gain if c.speedup and c.gain else None   # base / rival
            rows.append((c.params, before, c.speedup, c.baseline_name or duel.baseline,
                         host_bound(duel, c)))
    else:
        console.print(f"seed fitness {seed.fitness:.4f} -> best fitness "
                      f"{best.fitness if best else 0.0:.4f} ({best.id if best else '-'}"
                      f"{mode_text}) in {outcome.elapsed_s:.0f} s (this session{whole})")
        if best and best.result and seed.result:
            by_cfg = {str(c.params): c.speedup for c in seed.result.configs}
            rows = [(c.params, by_cfg.get(str(c.params)), c.speedup,
                     c.baseline_name or best.result.baseline, host_bound(best.result, c))
                    for c in best.result.configs]
    for params, before, after, versus, bound in rows:
        console.print(f"  {label(params)}: {before or 0:.3f}x -> {after or 0:.3f}x vs {versus}"
                      + (" (host-bound: the host's speed sets it)" if bound else ""))
    held, won = search.challenges
    if held:
        console.print(f"champion challenges: {held} children re-measured beside the best, "
                      f"{won} faster beyond noise")
    tried, set_back = search.set_back
    if tried:
        console.print(f"changes from the seed set back at the end: {set_back} of {tried} cost "
                      "nothing beside the best and were dropped")
    if final is not None:
        for line in side_by_side_lines(final, seed.id, best.id if best else ""):
            console.print(line)
    cost = cost_summary([p.result for p in search.programs.values() if p.result is not None],
                        outcome.elapsed_s, search.evaluated_this_session)
    if cost:
        where = "GPU" if plan.device == "cuda" else "evaluator"
        console.print(f"{cost}; {where} timing candidates {100 * outcome.gpu_busy:.0f}% of the "
                      "wall time")
    llm = search.llm_totals()
    if llm:
        console.print(f"LLM: {int(llm.get('calls', 0))} calls, {int(llm.get('prompt_tokens', 0))} "
                      f"tokens in, {int(llm.get('completion_tokens', 0))} out, "
                      f"${llm.get('cost_usd', 0.0):.4f} (the whole run)")


def seed_prompt_chars(config_path: str) -> int | None:
    """Returns the characters of a first LLM prompt for a config's seed (None if it cannot be
    built here: a CUDA seed without a GPU, say)."""
    from .mutators.prompts import PromptSettings, build_prompt
    from .types import MutationRequest, Program, program_id
    try:
        cfg = _absolute_paths(load_config(config_path), config_path)
        dev = settings.resolve_device(cfg.device)
        src = program.read(_find_seed(cfg.seed, config_path))
        prob = settings.problem(settings.problem_ref(cfg.problem, config_path))
    except (EvoattnError, program.ProgramError):
        return None
    seed = Program(program_id(src), src, Path(cfg.seed).suffix, None, 0, 0, "seed", "")
    req = MutationRequest(seed, (), 0, 1, problem_contract=prob.contract)
    target = detect_target(dev)
    prompt = build_prompt(req, PromptSettings(cfg.llm.output_format, cfg.llm.inspirations,
                                              {"target": target} if target else None))
    return prompt.chars if prompt else None


def _keep_llm_section(store: Any, cfg: RunConfig, console: Console) -> None:
    """Stores a changed llm section (another model, URL or price), so a later --resume uses it."""
    stored = store.stored_config()
    llm = config_to_dict(cfg)["llm"]
    if stored.get("llm") != llm:
        stored["llm"] = llm
        store.update_config(stored)
        console.print("the llm section differs from the run's: the run goes on with the new one")


def _config_spec(cfg: dict[str, Any]) -> str:
    """Returns the `--configs` text for one config."""
    if set(cfg) == {"B", "H", "S", "D", "causal"}:
        return f"{cfg['B']},{cfg['H']},{cfg['S']},{cfg['D']},{'causal' if cfg['causal'] else 'nc'}"
    return ",".join(f"{k}={v}" for k, v in cfg.items())


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
                    device: str | None,
                    overrides: dict[str, Any] | None = None) -> tuple[RunConfig, bool]:
    resuming = False
    if resume_dir and (config_path or output):
        raise UsageError("--resume continues a run with its stored config; "
                         "it takes no --config or --output")
    path = config_path or DEFAULT_CONFIG
    if resume_dir:
        cfg = dataclasses.replace(_stored_config(resume_dir), output=resume_dir)
        resuming = True
    else:
        # Stored with absolute seed and problem paths, so --resume works from any directory.
        cfg = _absolute_paths(load_config(path), path)
    over: dict[str, Any] = dict(overrides or {})
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


def _absolute_paths(cfg: RunConfig, config_path: str) -> RunConfig:
    """Returns cfg with its seed and problem file found relative to the config, made absolute."""
    return dataclasses.replace(cfg, seed=str(_find_seed(cfg.seed, config_path)),
                               problem=settings.problem_ref(cfg.problem, config_path))


def _find_seed(path: str, config_path: str | None) -> Path:
    found = settings.locate(path, config_path, "seed program")
    if found.suffix not in (".py", ".cu"):
        raise UsageError(f"{found}: seed must be a .py or .cu file")
    return found


__all__ = ["start_run", "plan_run"]
