"""The run configuration: frozen dataclasses, defaults in one place, strict YAML loading.

An unknown key, a value of the wrong type or a missing file is a ConfigError
naming the file and the dotted key. CLI flags override the file afterwards
with `dataclasses.replace`.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

from evoattn.contract.names import WIDTH
from evoattn.contract.request import DEFAULTS, DTYPES, TIMING_MODES

from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class PopulationConfig:
    islands: int = 2
    elites_per_island: int = 8
    migration_interval: int = 10       # iterations between ring migrations
    exploration: float = 0.3           # chance of a random elite as parent instead of a top one
    crossover_rate: float = 0.2        # chance a knob mutation crosses with another elite
    transplant_rate: float = 0.25      # chance it carries a one-knob gain found elsewhere
    # At the end of a run, set back each knob the best changed from the seed whose duel beside
    # the best shows it costs nothing (evoattn/prune.py): one duel per changed knob (those
    # whose code runs no call in the best: one duel together).
    prune: bool = True


@dataclasses.dataclass(frozen=True)
class MutatorConfig:
    kind: str = "knobs"                # "knobs" or "llm"
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = "gpt-4o-mini"
    weight: float = 1.0
    base_url: str | None = None        # None = OpenAI's API (https://api.openai.com/v1)
    # The variable holding the key. None: the provider's own (OPENAI_API_KEY for OpenAI's API,
    # GROQ_API_KEY for Groq's, ...: mutators/keys.py) and no key for any other server.
    api_key_env: str | None = None
    allow_key_to_other_host: bool = False   # send a provider's key (OPENAI_*...) elsewhere
    price_in_per_mtok: float = 0.0     # USD per million prompt tokens
    price_out_per_mtok: float = 0.0
    reasoning: bool = False            # o-series style: max_completion_tokens, no temperature
    # Prompt plus answer, in tokens. None: what the server's model list reports, else
    # mutators/budget.py's DEFAULT_CONTEXT_TOKENS.
    context_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class LlmConfig:
    models: tuple[ModelConfig, ...] = (ModelConfig(),)
    temperature: float = 0.7
    max_tokens: int = 8192
    timeout_s: float = 120.0
    max_retries: int = 4
    backoff_s: float = 2.0
    budget_usd: float | None = None
    concurrency: int = 2               # LLM requests in flight while the GPU evaluates
    inspirations: int = 3
    output_format: str = "diff"        # "diff" (SEARCH/REPLACE) or "full"
    max_consecutive_failures: int = 3  # failed calls in a row (one model) that stop the run
    # A prompt waits this long for earlier in-flight children of its parent to be committed,
    # so their outcomes reach the model (0: never wait, fastest, feedback may lag).
    feedback_wait_s: float = 60.0


@dataclasses.dataclass(frozen=True)
class EvaluatorConfig:
    """How candidates are evaluated. Unset values (None) mean evoattn/contract/request.py's defaults;
    tolerances left unset are the problem's own."""

    build_timeout_s: float = DEFAULTS.build_timeout_s
    run_timeout_s: float = DEFAULTS.run_timeout_s      # a ceiling: see run_deadline below
    trials: int = DEFAULTS.trials
    tolerance_factor: float | None = None
    tolerance_floor: float | None = None
    max_abs: float | None = None
    warmup: int | None = None
    reps: int | None = None
    policy: str = DEFAULTS.policy      # or "allow-library"
    screen: bool = DEFAULTS.screen     # stop a candidate's checks at its first failing config
    all_backends: bool = DEFAULTS.all_backends
    timing: str = DEFAULTS.timing      # what fitness measures: call | kernel | graph
    baseline: str = DEFAULTS.baseline  # "best" (the fastest per config) or a baseline's name
    # A candidate's run stage (after its build) may take this many times the seed's, but at
    # least run_floor_s and at most run_timeout_s: a hang costs seconds, not minutes.
    run_factor: float = 10.0
    run_floor_s: float = 60.0
    # True: a warm process per slot times the baselines once for all candidates (faster, but
    # apart from the candidate: host-bound configs then swing by tens of % between
    # evaluations). False: each candidate's baselines in its own interleaved rounds.
    station: bool = False
    baseline_refresh_s: float = 60.0   # ... again between candidates once this old
    backend: str = "local"             # "local" (this machine's GPUs) or "dask"
    scheduler_address: str | None = None   # the Dask scheduler, e.g. tcp://host:8786
    gpus: tuple[int, ...] | None = None    # local: the GPU indices to use (default: all visible)
    # Evaluations in flight per local GPU. Above 1 they take turns on the GPU
    # (evoattn/child/gpu_turn.py): one's start, build and baselines' set-up overlap another's
    # checks, Triton's compiles hand the turn on, and nothing else runs on the GPU while
    # one times. Faster only where set-ups and compiles are a large share (BENCHMARKS.md).
    per_gpu: int = 1
    # On a GPU, each slot keeps spare processes that set up the next candidates' evaluations
    # (CUDA, the baselines' plans, inputs and references: seconds) while one is evaluated;
    # never while another evaluation times (evoattn/child/gpu_turn.py). No effect with a station.
    # A candidate out of GPU memory beside them is evaluated again without (sandbox.py).
    spare: bool = True
    # The fitness mode's target interval (relative half-width, 95%) for a plain candidate,
    # and whether it is timed in graph mode too. A candidate that would become a best is
    # re-measured against it head to head at the request's width (1%), in every mode.
    candidate_width: float = WIDTH
    candidate_graph: bool = False
    # ... and whether its heavy configs get call mode's heat (evoattn/child/timing.py): with it,
    # their call times are a sustained loop's; without (the default), they read 1-10% faster
    # on an H200 and an evaluation takes 3-6 s less. Plain candidates are ranked against each
    # other and the best's own plain figure, so the protocol is the same on both sides; a
    # would-be best's duel, the run's summary and `evoattn eval` always heat.
    candidate_heat: bool = False
    # On a GPU, time on the fastest CPU of the machine (of the GPU's block, with several GPUs),
    # pinned for the timing: launch-bound times depend on the host's speed, which differs
    # between the CPUs of one machine (evoattn/child/cpu_pin.py).
    pin_cpu: bool = DEFAULTS.pin_cpu
    # Iterations in flight (default: one per evaluation slot, plus llm.concurrency). A fixed
    # window keeps a run's choices the same on any number of GPUs or workers.
    window: int | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    problem: str = "sdpa"
    seed: str = "seeds/sdpa/flash_hybrid.py"
    configs: tuple[str, ...] | None = None  # "B,H,S,D[,causal|nc]" strings; None = defaults
    # Every candidate is checked in each, timed in the first; None = the problem's default.
    # A file's `dtype: X` (one dtype, the older key) reads as `dtypes: [X]`.
    dtypes: tuple[str, ...] | None = None
    device: str = "auto"                    # auto | cuda | cpu
    iterations: int = 100
    random_seed: int = 0
    output: str = "runs/default"
    max_wall_s: float | None = None
    target_fitness: float | None = None
    population: PopulationConfig = PopulationConfig()
    mutators: tuple[MutatorConfig, ...] = (MutatorConfig(),)
    llm: LlmConfig = LlmConfig()
    evaluator: EvaluatorConfig = EvaluatorConfig()


# An env var name; upper case only, so a literal key (mixed case) never passes for one.
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
_CHOICES = {
    "device": ("auto", "cuda", "cpu"),
    "mutators.kind": ("knobs", "llm"),
    "evaluator.policy": ("kernel-only", "allow-library"),
    "evaluator.timing": TIMING_MODES,
    "evaluator.backend": ("local", "dask"),
    "llm.output_format": ("diff", "full"),
}


def load_config(path: str | Path) -> RunConfig:
    """Returns the RunConfig in a YAML file; raises ConfigError naming file and key."""
    p = Path(path)
    cfg = _build(RunConfig, _one_dtype_key(_read_yaml(p), str(p)), str(p), "")
    check_config(cfg, str(p))
    return cfg


def load_llm_section(path: str | Path) -> LlmConfig | None:
    """Returns a config file's llm: section (the whole file checked), or None if it has none."""
    cfg = load_config(path)
    return cfg.llm if "llm" in _read_yaml(Path(path)) else None


def _read_yaml(p: Path) -> dict[str, Any]:
    """Returns a config file's top-level mapping; raises ConfigError naming the file."""
    import yaml

    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise ConfigError(f"{p}{where}: malformed YAML: {getattr(e, 'problem', e)}") from None
    if raw is None:
        raise ConfigError(f"{p}: the file is empty (a run config needs at least problem: and "
                          "seed:; see configs/default.yaml)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: top level must be a mapping of keys, got {type(raw).__name__}")
    return raw


def _one_dtype_key(raw: dict[str, Any], origin: str) -> dict[str, Any]:
    """Returns the raw config with a `dtype: X` key read as `dtypes: [X]` (null: left out)."""
    if "dtype" not in raw:
        return raw
    if "dtypes" in raw:
        raise ConfigError(f"{origin}: keys 'dtype' and 'dtypes' are both set; keep 'dtypes' "
                          "(a list, e.g. [float16, bfloat16])")
    out = {k: v for k, v in raw.items() if k != "dtype"}
    if raw["dtype"] is not None:
        if not isinstance(raw["dtype"], str):
            raise ConfigError(f"{origin}: key 'dtype' must be a string, got "
                              f"{_tname(raw['dtype'])}")
        out["dtypes"] = [raw["dtype"]]
    return out


def config_to_dict(cfg: Any) -> Any:
    """Returns a plain dict (YAML/JSON-ready) of a config dataclass."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [config_to_dict(v) for v in cfg]
    return cfg


def config_from_dict(raw: dict[str, Any], origin: str = "<stored config>") -> RunConfig:
    """Returns a RunConfig from a dict (as saved in a run directory)."""
    cfg = _build(RunConfig, _one_dtype_key(raw, origin), origin, "")
    check_config(cfg, origin)
    return cfg


def _build(cls: type, raw: Any, origin: str, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: key '{prefix.rstrip('.') or '<top>'}' must be a mapping")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            known = ", ".join(sorted(names))
            raise ConfigError(f"{origin}: unknown key '{prefix}{key}' (known: {known})")
    kw = {k: _coerce(hints[k], v, origin, prefix + k) for k, v in raw.items()}
    return cls(**kw)


def _coerce(tp: Any, value: Any, origin: str, key: str) -> Any:
    origin_t = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin_t in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, origin, key)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, origin, key + ".")
    if origin_t is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{origin}: key '{key}' must be a list, got {_tname(value)}")
        return tuple(_coerce(args[0], v, origin, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{origin}: key '{key}' must be a number, got {_tname(value)}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{origin}: key '{key}' must be an integer, got {_tname(value)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{origin}: key '{key}' must be true or false, got {_tname(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{origin}: key '{key}' must be a string, got {_tname(value)}")
        return value
    return value


def _tname(v: Any) -> str:
    return "null" if v is None else f"{type(v).__name__} {v!r}"


def check_config(cfg: RunConfig, origin: str) -> None:
    """Raises ConfigError if a value is out of range (also used after CLI overrides)."""
    def bad(key: str, msg: str) -> ConfigError:
        return ConfigError(f"{origin}: key '{key}' {msg}")

    if cfg.device not in _CHOICES["device"]:
        raise bad("device", f"must be one of {_CHOICES['device']}, got {cfg.device!r}")
    _check_dtypes(cfg.dtypes, bad)
    if cfg.evaluator.policy not in _CHOICES["evaluator.policy"]:
        raise bad("evaluator.policy", f"must be one of {_CHOICES['evaluator.policy']}")
    if cfg.llm.output_format not in _CHOICES["llm.output_format"]:
        raise bad("llm.output_format", "must be 'diff' or 'full'")
    if not cfg.mutators:
        raise bad("mutators", "must list at least one mutator")
    for i, m in enumerate(cfg.mutators):
        if m.kind not in _CHOICES["mutators.kind"]:
            raise bad(f"mutators[{i}].kind", f"must be 'knobs' or 'llm', got {m.kind!r}")
        if m.weight <= 0:
            raise bad(f"mutators[{i}].weight", "must be > 0")
    if cfg.iterations < 0:
        raise bad("iterations", "must be >= 0")
    if cfg.population.islands < 1:
        raise bad("population.islands", "must be >= 1")
    if cfg.population.elites_per_island < 1:
        raise bad("population.elites_per_island", "must be >= 1")
    for key in ("exploration", "crossover_rate", "transplant_rate"):
        if not 0.0 <= getattr(cfg.population, key) <= 1.0:
            raise bad(f"population.{key}", "must be between 0 and 1 (a chance)")
    if cfg.evaluator.trials < 1:
        raise bad("evaluator.trials", "must be >= 1")
    for key in ("timing", "backend"):
        allowed = _CHOICES[f"evaluator.{key}"]
        if getattr(cfg.evaluator, key) not in allowed:
            raise bad(f"evaluator.{key}", f"must be one of {', '.join(allowed)}, got "
                      f"{getattr(cfg.evaluator, key)!r}")
    if cfg.evaluator.backend == "dask" and not cfg.evaluator.scheduler_address:
        raise bad("evaluator.scheduler_address", "is needed with backend: dask "
                  "(e.g. tcp://host:8786)")
    for key in ("warmup", "reps"):
        value = getattr(cfg.evaluator, key)
        if value is not None and value < 0:
            raise bad(f"evaluator.{key}", "must be >= 0")
    if cfg.evaluator.window is not None and cfg.evaluator.window < 1:
        raise bad("evaluator.window", "must be >= 1 (or null: one per evaluation slot)")
    if cfg.evaluator.per_gpu < 1:
        raise bad("evaluator.per_gpu", "must be >= 1")
    if not 0 < cfg.evaluator.candidate_width < 1:
        raise bad("evaluator.candidate_width", "must be between 0 and 1 (e.g. 0.02: 2%)")
    if cfg.evaluator.run_factor <= 0 or cfg.evaluator.run_floor_s <= 0:
        raise bad("evaluator.run_factor", "and run_floor_s must be > 0")
    if any(m.kind == "llm" for m in cfg.mutators) and not cfg.llm.models:
        raise bad("llm.models", "must list at least one model when an llm mutator is used")
    _check_llm(cfg.llm, bad)


def _check_dtypes(dtypes: tuple[str, ...] | None, bad: Any) -> None:
    if dtypes is None:
        return
    if not dtypes:
        raise bad("dtypes", f"must list at least one of {', '.join(DTYPES)} (or be left out: "
                  "the problem's default)")
    for i, d in enumerate(dtypes):
        if d not in DTYPES:
            raise bad(f"dtypes[{i}]", f"must be one of {', '.join(DTYPES)}, got {d!r}")
        if d in dtypes[:i]:
            raise bad(f"dtypes[{i}]", f"names {d} a second time")


def _check_llm(llm: LlmConfig, bad: Any) -> None:
    for key in ("max_tokens", "max_consecutive_failures"):
        if getattr(llm, key) < 1:
            raise bad(f"llm.{key}", "must be >= 1")
    for key in ("timeout_s", "backoff_s", "feedback_wait_s"):
        if getattr(llm, key) < 0 or (key == "timeout_s" and llm.timeout_s == 0):
            raise bad(f"llm.{key}", "must be > 0" if key == "timeout_s" else "must be >= 0")
    if llm.max_retries < 0 or llm.concurrency < 0 or llm.inspirations < 0:
        raise bad("llm.max_retries", "concurrency and inspirations must be >= 0")
    for i, model in enumerate(llm.models):
        env = model.api_key_env
        if env is not None and not ENV_NAME.match(env):   # never echo it: it may be the key
            raise bad(f"llm.models[{i}].api_key_env", "must be the NAME of an environment "
                      "variable (A-Z, 0-9, _) that holds the key, not the key")
        if model.context_tokens is not None and model.context_tokens < 1024:
            raise bad(f"llm.models[{i}].context_tokens", "must be >= 1024 (or null: asked of "
                      "the server)")
        if model.base_url is not None and not re.match(r"^https?://[^/\s]+", model.base_url):
            raise bad(f"llm.models[{i}].base_url", "must be an http:// or https:// URL, "
                      "e.g. http://127.0.0.1:8000/v1")
