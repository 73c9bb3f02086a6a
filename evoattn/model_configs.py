"""Reads a Hugging Face model's attention from its config and derives the `model` problem's configs.

CONFIG is a local `config.json` (or a directory holding one) or a transformers model type
(`gemma2`, `gpt_oss`, `mistral`, `llama`, ...: its default config). No weights and no network.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable

from .errors import UsageError

# the run settings `run --model` starts from, per phase
MODEL_RUN_CONFIG = {"prefill": "configs/model.yaml", "decode": "configs/model_decode.yaml"}
PREFILL_LENGTHS = (1024, 2048, 4096, 8192, 16384)
TOKENS = 16 * 1024                   # B * S of a derived prefill config
# The eager baseline holds several (B, H, S, S) 16-bit score tensors: one of at most 9 GiB
# (GPT-OSS's 64 heads at B=1, S=8k, the largest of the problem's own configs) fits a GPU.
EAGER_SCORES_BYTES = 9 * 2**30
HEAD_DIMS = (64, 128, 256)           # the model problem's contract (model_prefill.HEAD_DIMS)


@dataclasses.dataclass(frozen=True)
class ModelAttention:
    """The attention-relevant fields of a model config (window 0: none; softcap 0.0: none)."""

    source: str                      # the file or model type it was read from
    model_type: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int                      # the sliding window of the windowed layers
    windowed_layers: int             # how many layers use it
    layers: int
    softcap: float
    sinks: bool
    scale: float
    max_positions: int

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Returns the distinct windows of the model's layer kinds (0: global)."""
        kinds = []
        if self.windowed_layers < self.layers or not self.window:
            kinds.append(0)
        if self.window and self.windowed_layers:
            kinds.append(self.window)
        return tuple(kinds)


def read(config_or_type: str) -> ModelAttention:
    """Returns the attention of a config.json (file or directory) or a transformers model type."""
    raw, source = _load(config_or_type)
    return _attention(raw, source)


def hf_config(config_or_type: str) -> Any:
    """Returns the transformers config of a config.json or model type (to build a model of)."""
    cfg, source = _load(config_or_type)
    if isinstance(cfg, dict):
        raise UsageError(f"{source}: key 'model_type' is missing (needed to build the model)")
    return cfg


def _load(spec: str) -> tuple[Any, str]:
    """Returns the config (a transformers config where its type is known, else the dict)."""
    p = Path(spec)
    if p.is_dir():
        p = p / "config.json"
    is_file = p.suffix == ".json" or "/" in spec or p.exists()
    if is_file:
        if not p.is_file():
            raise UsageError(f"{p}: model config file not found")
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"{p}: not a JSON model config ({e})") from None
        if not isinstance(data, dict):
            raise UsageError(f"{p}: a model config must be a JSON object")
        if "num_attention_heads" in data:     # before transformers divides by it
            _check_heads(data["num_attention_heads"], str(p))
        mtype = data.get("model_type")
        return (_for_model(mtype, str(p), data) if mtype else data), str(p)
    return _for_model(spec, spec, {}), spec


def _for_model(model_type: str, source: str, data: dict[str, Any]) -> Any:
    from transformers import AutoConfig
    fields = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:           # transformers' own checks raise ValueError, TypeError, ...
        if "Unrecognized model identifier" not in str(e):
            raise UsageError(f"{source}: transformers cannot make a {model_type} config of it "
                             f"({type(e).__name__}: {e})") from None
        raise UsageError(f"{source}: unknown model type {model_type!r} (transformers has no "
                         "config of that name; give a config.json or a type such as gemma2, "
                         "gpt_oss, mistral, llama)") from None


def _attention(cfg: Any, source: str) -> ModelAttention:
    """Returns the fields the attention uses; raises UsageError naming a missing or bad key."""
    def get(key: str) -> Any:
        return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)

    heads = _check_heads(get("num_attention_heads"), source)
    kv = get("num_key_value_heads") or heads
    if heads % kv:
        raise UsageError(f"{source}: key 'num_key_value_heads' ({kv}) must divide "
                         f"num_attention_heads ({heads})")
    head_dim = get("head_dim") or (get("hidden_size") or 0) // heads
    if head_dim not in HEAD_DIMS:
        raise UsageError(f"{source}: key 'head_dim' is {head_dim or 'missing'}; the model "
                         f"problem takes head dims {', '.join(map(str, HEAD_DIMS))}")
    layers = int(get("num_hidden_layers") or 1)
    window = int(get("sliding_window") or 0)
    types = get("layer_types")
    if window and types:
        windowed = sum(t == "sliding_attention" for t in types)
        layers = len(types)
    else:                            # Mistral's convention: a window applies to every layer
        windowed = layers if window else 0
    model_type = str(get("model_type") or "?")
    softcap = float(get("attn_logit_softcapping") or 0.0)
    pre = get("query_pre_attn_scalar")
    scale = float(pre) ** -0.5 if pre else 1 / math.sqrt(head_dim)
    max_pos = int(get("max_position_embeddings") or 0)
    if max_pos < 1:
        raise UsageError(f"{source}: key 'max_position_embeddings' is missing")
    return ModelAttention(source, model_type, heads, kv, head_dim, window, windowed, layers,
                          softcap, model_type == "gpt_oss", scale, max_pos)


def _check_heads(heads: Any, source: str) -> int:
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise UsageError(f"{source}: key 'num_attention_heads' is missing or not a positive "
                         "integer (not a decoder model config?)")
    return heads


def derive_configs(ma: ModelAttention, phase: str = "prefill") -> list[dict[str, Any]]:
    """Returns the configs of the phase's problem (PHASES) for the model's attention."""
    return PHASES[phase].derive(ma)


def prefill_configs(ma: ModelAttention, lengths: tuple[int, ...] = PREFILL_LENGTHS,
                    tokens: int = TOKENS) -> list[dict[str, Any]]:
    """Returns the prefill configs: per length within max positions, one per distinct layer kind."""
    out = []
    for S in (s for s in lengths if s <= ma.max_positions):
        B = min(max(1, tokens // S), EAGER_SCORES_BYTES // (ma.heads * S * S * 2))
        if B < 1:                    # past what the eager baseline can hold
            continue
        # A window as long as the sequence is plain causal: that layer kind is the global one.
        windows = dict.fromkeys(w if 0 < w < S else 0 for w in ma.layer_windows)
        out += [_config(ma, B, S, w) for w in windows]
    if not out:
        raise UsageError(f"{ma.source}: max_position_embeddings {ma.max_positions} is below the "
                         f"shortest prefill length {min(lengths)}")
    return out


@dataclasses.dataclass(frozen=True)
class Phase:
    """A part of a model's attention run as a problem: its name, seed and configs."""

    problem: str
    seed: str
    derive: Callable[[ModelAttention], list[dict[str, Any]]]


# One generation step of a batch: (B, new tokens T, cache length), each at every layer kind
# whose window is shorter than the cache; "ragged" lengths where B > 1, as a padded batch has.
DECODE_STEPS = ((1, 1, 16384), (8, 1, 4096), (16, 1, 8192), (4, 4, 8192), (1, 16, 16384))


def decode_configs(ma: ModelAttention, steps: tuple[tuple[int, int, int], ...] = DECODE_STEPS
                   ) -> list[dict[str, Any]]:
    """Returns the decode configs: per step within max positions, one per distinct layer kind."""
    out = []
    for B, T, ctx in (s for s in steps if s[2] <= ma.max_positions):
        windows = dict.fromkeys(w if 0 < w < ctx else 0 for w in ma.layer_windows)
        out += [_decode_config(ma, B, T, ctx, w) for w in windows]
    if not out:
        raise UsageError(f"{ma.source}: max_position_embeddings {ma.max_positions} is below the "
                         f"shortest decode context {min(s[2] for s in steps)}")
    return out


PHASES = {"prefill": Phase("model", "seeds/model/model_triton.py", prefill_configs),
          "decode": Phase("model_decode", "seeds/model/model_decode_triton.py", decode_configs)}


def cpu_configs(ma: ModelAttention, cpu_S: int, phase: str = "prefill") -> list[dict[str, Any]]:
    """Returns one config per layer kind at the CPU's length (B 1; a window shrunk to S/4)."""
    S = min(cpu_S, ma.max_positions)
    windows = dict.fromkeys(min(w, max(1, S // 4)) if w else 0 for w in ma.layer_windows)
    if phase == "decode":
        return [_decode_config(ma, 1, 1, S, w) for w in windows]
    return [_config(ma, 1, S, w) for w in windows]


def _config(ma: ModelAttention, B: int, S: int, window: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {"B": B, "H": ma.heads, "Hkv": ma.kv_heads, "S": S, "D": ma.head_dim,
                           "window": window, "softcap": ma.softcap, "sinks": ma.sinks}
    if not math.isclose(ma.scale, 1 / math.sqrt(ma.head_dim)):
        cfg["scale"] = ma.scale      # only where it is not the problem's default
    return cfg


def _decode_config(ma: ModelAttention, B: int, T: int, ctx: int, window: int) -> dict[str, Any]:
    cfg = _config(ma, B, 0, window)
    del cfg["S"]
    cfg.update(T=T, ctx=ctx, lens="ragged" if B > 1 else "full")
    return cfg


def config_spec(cfg: dict[str, Any]) -> str:
    """Returns a config as a run config's `configs:` entry ('key=value,...')."""
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def table(ma: ModelAttention, configs: list[dict[str, Any]], note: str = "") -> Any:
    """Returns a rich table of the model's attention and the configs derived from it."""
    from rich.table import Table
    kinds = ", ".join(f"{ma.windowed_layers} windowed ({ma.window})" if w else
                      f"{ma.layers - ma.windowed_layers} global" for w in ma.layer_windows)
    title = (f"{ma.source} ({ma.model_type}): {ma.heads}/{ma.kv_heads} heads of {ma.head_dim}, "
             f"layers {kinds}, softcap {ma.softcap:g}, sinks {'yes' if ma.sinks else 'no'}, "
             f"scale {ma.scale:.4g}, max positions {ma.max_positions}")
    t = Table(title=title, caption=note or None)
    shape = ("B", "H", "Hkv", "S", "D") if "S" in configs[0] else ("B", "H", "Hkv", "T", "ctx", "D")
    for col in shape + ("window", "softcap", "sinks"):
        t.add_column(col, justify="right")
    for c in configs:
        t.add_row(*(str(c[k]) for k in shape),
                  str(c["window"] or "-"), f"{c['softcap']:g}" if c["softcap"] else "-",
                  "yes" if c["sinks"] else "-")
    return t


def run_overrides(spec: str, config_path: str, device: str | None,
                  phase_name: str = "prefill") -> tuple[dict[str, Any], Any]:
    """Returns the RunConfig keys `run --model` sets (problem, seed, configs) and their table."""
    from . import settings
    from .config import load_config
    cfg = load_config(config_path)
    ma = read(spec)
    phase = PHASES[phase_name]
    over: dict[str, Any] = {"problem": phase.problem}
    if settings.problem_ref(cfg.problem, config_path) != phase.problem:
        # Another problem's seed cannot serve this one; a model config's own seed is kept.
        over["seed"] = str(settings.locate(phase.seed, config_path, "seed program"))
    dev = settings.resolve_device(device or cfg.device, here=cfg.evaluator.backend == "local")
    if dev == "cpu":
        length = "S" if phase_name == "prefill" else "ctx"
        cpu_S = max(c[length] for c in settings.problem(phase.problem).cpu_configs)
        configs = cpu_configs(ma, cpu_S, phase_name)
        note = (f"CPU (Triton's interpreter): each layer kind at {length}={configs[0][length]}, B=1, the "
                "problem's CPU size, windows shrunk to a quarter of it; on a GPU: the "
                f"{phase_name} configs of the model's lengths")
    elif phase_name == "prefill":
        configs = phase.derive(ma)
        note = (f"prefill, B = max(1, {TOKENS} // S) within the eager baseline's memory (its "
                f"(B, H, S, S) scores <= {EAGER_SCORES_BYTES >> 30} GiB), one config per "
                "distinct layer kind")
    else:
        configs = phase.derive(ma)
        note = ("decode steps (B, new tokens T, cache length ctx) within max positions, one "
                "config per distinct layer kind; ragged lengths where B > 1")
    over["configs"] = tuple(config_spec(c) for c in configs)
    return over, table(ma, configs, note)
