"""`evoattn bench-model`: an exported package's attention inside a Hugging Face model, against
the model's built-in implementations and a null attention (zeros, no work).

One model (random weights, built on the device) has its attention implementation switched
between rows; rows are timed interleaved, round by round (the order reversed every other
round), and the median of the rounds kept.
Per workload (a prefill at (B, S), greedy generation) and row:
  s = 1 - t_null / t_row         the share of the model's time that attention takes
  r = a_base / a_row             op-level speedup over the fastest built-in (base): a_* is the
                                 time of the attention calls alone, each call timed on its own
                                 in a separate pass (synchronised around it)
  predicted = 1 / (1 - s_base + s_base / r)   Amdahl's law: what the op speedup should give
  gain = t_base / t_row          what the model measured
  kept = (gain - 1) / (predicted - 1)   the share of the predicted gain the model realised
Accuracy: logits and teacher-forced top-1 agreement against the same weights in float32
(eager attention), on one sequence.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .errors import EvoattnError, UsageError

NULL = "evoattn_null"
TIMED = "evoattn_timed_"             # + a row's name: its attention calls timed one by one
BUILTINS = ("eager", "sdpa", "flex_attention")


@dataclasses.dataclass(frozen=True)
class Row:
    """One implementation on one workload (None where a figure does not apply)."""

    name: str
    workload: str                    # "prefill B=.. S=.." or "generate B=.. P=.. N=.."
    time_ms: float | None            # None: the row raised (error)
    op_time_ms: float | None         # the attention calls alone
    tokens_per_s: float | None
    share: float | None              # s
    op_speedup: float | None         # r against the base
    predicted: float | None
    gain: float | None
    kept: float | None               # (gain - 1) / (predicted - 1): the share of it realised
    stats: dict[str, Any] | None     # the package's calls on the kernel / fallback
    error: str | None = None         # what the implementation raised in this model


@dataclasses.dataclass(frozen=True)
class Accuracy:
    """A row's logits against the float32 model on one sequence."""

    name: str
    max_abs_logit_err: float | None  # None: the row raised
    top1_agreement: float | None


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """Every row of a bench-model run, with what it ran on."""

    model: str
    device: str
    dtype: str
    rounds: int
    base: dict[str, str]             # workload -> the fastest built-in
    rows: tuple[Row, ...]
    accuracy: tuple[Accuracy, ...]
    notes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What to measure (shapes as (B, S); generation: batch, prompt length, new tokens)."""

    shapes: tuple[tuple[int, int], ...] = ((1, 8192), (4, 2048))
    gen: tuple[int, int, int] = (8, 4096, 128)
    rounds: int = 5
    warmup: int = 1
    impls: tuple[str, ...] | None = None      # None: every built-in the model supports
    layers: int | None = None                 # cut the model to this many layers
    acc_len: int = 1024


def settings_from(shapes: tuple[str, ...], gen: str | None, rounds: int,
                  impls: tuple[str, ...], layers: int | None) -> Settings:
    """Returns the Settings the command line gives ('B,S' shapes, 'B,PROMPT,NEW')."""
    if rounds < 1 or (layers is not None and layers < 1):
        raise UsageError("--rounds and --layers must be >= 1")
    return Settings(shapes=tuple(_ints(s, 2, "--shape") for s in shapes) or Settings.shapes,
                    gen=_ints(gen, 3, "--generate") if gen else Settings.gen, rounds=rounds,
                    impls=impls or None, layers=layers)


def _ints(text: str, n: int, option: str) -> Any:
    """Returns n comma-separated integers (>= 1; NEW may be 0); anything else is a UsageError."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != n or min(values[:2]) < 1 or values[-1] < 0:
        raise UsageError(f"{option} {text}: expected {n} comma-separated integers "
                         "(sizes >= 1)")
    return values


def load_package(spec: str) -> Any:
    """Returns an exported package: a directory (the export's or the package's) or a name."""
    p = Path(spec)
    if p.is_dir():
        pkg_dir = p if (p / "hf.py").is_file() else next(
            (d for d in sorted(p.iterdir()) if (d / "hf.py").is_file()), None)
        if pkg_dir is None:
            raise UsageError(f"{spec}: no exported package here (no hf.py in it or below it)")
        sys.path.insert(0, str(pkg_dir.parent))
        spec = pkg_dir.name
    try:
        pkg = importlib.import_module(spec)
        importlib.import_module(f"{spec}.hf")
    except ImportError as e:
        raise UsageError(f"{spec}: cannot import the package ({e})") from None
    return pkg


def build_model(model_spec: str, device: str, layers: int | None) -> Any:
    """Returns a causal LM of the config with random weights, built on the device, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from .model_configs import hf_config
    cfg = hf_config(model_spec)
    if layers is not None:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    try:
        with torch.device(device):   # a host init of a billion-parameter model takes minutes
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    except ValueError as e:
        raise UsageError(f"{model_spec}: no causal LM for this config ({e})") from None
    return model.eval()


def supported(model: Any) -> tuple[str, ...]:
    """Returns the built-in implementations the model declares it supports."""
    flags = {"eager": True, "sdpa": getattr(model, "_supports_sdpa", False),
             "flex_attention": getattr(model, "_supports_flex_attn", False)}
    return tuple(n for n in BUILTINS if flags[n])


def register_helpers(builtin_and_pkg: tuple[str, ...]) -> None:
    """Registers the null attention and a timed twin of each row's attention function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import (ALL_MASK_ATTENTION_FUNCTIONS,
                                            AttentionMaskInterface, sdpa_mask)
    AttentionInterface.register(NULL, null_attention)
    AttentionMaskInterface.register(NULL, sdpa_mask)     # plain causal: no mask is built
    for name in builtin_and_pkg:     # each twin builds the masks its row builds
        AttentionInterface.register(TIMED + name, _timed(name))
        AttentionMaskInterface.register(TIMED + name, ALL_MASK_ATTENTION_FUNCTIONS[name]
                                        if name in ALL_MASK_ATTENTION_FUNCTIONS else sdpa_mask)


def null_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                   **kwargs: Any) -> tuple[Any, None]:
    """Returns zeros of the attention output's shape (B, S, H, D): attention with no work."""
    import torch
    B, H, S, _ = query.shape
    return torch.zeros(B, S, H, value.shape[-1], dtype=query.dtype, device=query.device), None


_OP_TIME = [0.0]                     # seconds the timed attention calls took (this pass)


def _timed(name: str) -> Callable[..., Any]:
    """Returns `name`'s attention function, each call synchronised and its time added up."""
    def forward(module: Any, *args: Any, **kwargs: Any) -> Any:
        fn = _attention_function(name, module)
        _sync(args[0])
        t0 = time.perf_counter()
        out = fn(module, *args, **kwargs)
        _sync(args[0])
        _OP_TIME[0] += time.perf_counter() - t0
        return out
    return forward


def _attention_function(name: str, module: Any) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if name == "eager":              # the model's own, in its modeling module
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _sync(t: Any) -> None:
    import torch
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _time_once(run: Callable[[], Any], device: str) -> float:
    import torch
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(model: Any, pkg: Any, pkg_name: str, model_spec: str, device: str,
            st: Settings) -> BenchResult:
    """Returns every row's timings, shares, speedups and accuracy (interleaved rounds)."""
    import torch
    builtins = tuple(n for n in (st.impls or supported(model)) if n in BUILTINS)
    names = builtins + (pkg_name,)
    register_helpers(names)
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(0)

    def ids(b: int, s: int) -> Any:
        return torch.randint(0, vocab, (b, s), generator=gen).to(device)

    workloads: list[tuple[str, Callable[[], Any], int]] = []
    for b, s in st.shapes:
        x = ids(b, s)
        workloads.append((f"prefill B={b} S={s}", _prefill(model, x), b * s))
    gb, prompt, new = st.gen
    if new > 0:
        x = ids(gb, prompt)
        workloads.append((f"generate B={gb} P={prompt} N={new}", _generate(model, x, new),
                          gb * new))
    rows: list[Row] = []
    base: dict[str, str] = {}
    with torch.no_grad():
        for label, run, tokens in workloads:
            failed = _warm_up(model, pkg, names, run, st.warmup)
            ok = tuple(n for n in names if n not in failed)
            got = _workload(model, ok, run, device, st.rounds)
            stats = failed.pop("", None)
            if pkg_name in got:
                got[pkg_name] = got[pkg_name][:2] + (stats,)
            built = [n for n in builtins if n in got]
            if not built or NULL in failed:
                raise EvoattnError(f"{model_spec}: the model cannot run its built-in or the "
                                   f"null attention: {failed}")
            base[label] = min(built, key=lambda n: got[n][0])
            rows += _rows(label, got, base[label], pkg_name, tokens)
            rows += [Row(n, label, *(None,) * 9, error=e) for n, e in failed.items()]
        accuracy = _accuracy(model, names, ids(1, min(st.acc_len, st.shapes[0][1])))
    notes = ["base: the fastest built-in per workload; s = 1 - t_null/t; r = base's attention "
             "calls / the row's (op level); predicted = 1/(1 - s_base + s_base/r); kept = "
             "(gain - 1)/(predicted - 1)"]
    if device == "cpu":
        notes.append("CPU: a tiny model in float32; the package's kernel runs on CUDA GPUs, so "
                     "its calls fall back (see its stats) and no figure here is a GPU's")
    return BenchResult(model_spec, device, str(next(model.parameters()).dtype).split(".")[-1],
                       st.rounds, base, tuple(rows), accuracy, tuple(notes))


def _prefill(model: Any, x: Any) -> Callable[[], Any]:
    # As generate's prefill runs it: a fresh cache filled, the last position's logits only
    # ((B, S, vocab) would be gigabytes and bury the layers)
    return lambda: model(x, use_cache=True, logits_to_keep=1)


def _generate(model: Any, x: Any, new: int) -> Callable[[], Any]:
    import torch
    mask = torch.ones_like(x)
    eos = getattr(model.config, "eos_token_id", None)
    pad = (eos[0] if isinstance(eos, (list, tuple)) else eos) or 0   # no padding: any id
    return lambda: model.generate(x, attention_mask=mask, max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=pad)


def _warm_up(model: Any, pkg: Any, names: tuple[str, ...], run: Callable[[], Any],
             warmup: int) -> dict[str, Any]:
    """Runs each row once or more; returns name -> what it raised ("" -> the package's stats)."""
    out: dict[str, Any] = {}
    for name in names + (NULL,):
        pkg.reset_stats()
        try:
            model.set_attn_implementation(name)   # raises for one the model does not support
            for i in range(max(1, warmup)):
                run()
                if i == 0 and name == names[-1]:
                    out[""] = pkg.stats()
        except Exception as e:       # an implementation this model breaks is a row, not a crash
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out


def _workload(model: Any, names: tuple[str, ...], run: Callable[[], Any], device: str,
              rounds: int) -> dict[str, Any]:
    """Returns name -> (median seconds, median attention-call seconds, None)."""
    everyone = names + (NULL,)
    times: dict[str, list[float]] = {n: [] for n in everyone}
    ops: dict[str, list[float]] = {n: [] for n in names}
    for name in names:               # the timed twins' first calls, untimed
        model.set_attn_implementation(TIMED + name)
        run()
    for i in range(rounds):
        for name in everyone if i % 2 == 0 else everyone[::-1]:   # no row always first
            model.set_attn_implementation(name)
            times[name].append(_time_once(run, device))
        for name in names:
            model.set_attn_implementation(TIMED + name)
            _OP_TIME[0] = 0.0
            run()
            ops[name].append(_OP_TIME[0])
    return {n: (statistics.median(times[n]), statistics.median(ops[n]) if n in ops else None,
                None) for n in everyone}


def _rows(label: str, got: dict[str, tuple[float, float | None, dict | None]], base: str,
          pkg_name: str, tokens: int) -> list[Row]:
    """Returns the workload's rows: s, r, the Amdahl prediction and the gain against base."""
    t_null = got[NULL][0]
    t_base, a_base, _ = got[base]
    s_base = 1 - t_null / t_base
    rows = []
    for name, (t, a, stats) in got.items():
        if name == NULL:
            rows.append(Row(name, label, t * 1e3, None, tokens / t, *(None,) * 6))
            continue
        r = a_base / a if a else None
        pred = 1 / (1 - s_base + s_base / r) if r else None
        kept = (t_base / t - 1) / (pred - 1) if pred and abs(pred - 1) > 1e-6 else None
        rows.append(Row(name, label, t * 1e3, a * 1e3 if a is not None else None, tokens / t,
                        1 - t_null / t, r, pred, t_base / t, kept, stats))
    return rows


def _accuracy(model: Any, names: tuple[str, ...], x: Any) -> tuple[Accuracy, ...]:
    """Returns each row's logits error and top-1 agreement against the float32 model."""
    import torch
    ref_model = copy.deepcopy(model).to(torch.float32)   # the same weights, in float32
    ref_model.set_attn_implementation("eager")
    ref = ref_model(x, use_cache=False).logits.float()
    del ref_model
    top = ref.argmax(-1)
    out = []
    for name in names:
        try:
            model.set_attn_implementation(name)
            got = model(x, use_cache=False).logits.float()
        except Exception:            # said once, in its timing row
            out.append(Accuracy(name, None, None))
            continue
        out.append(Accuracy(name, (got - ref).abs().max().item(),
                            (got.argmax(-1) == top).float().mean().item()))
    return tuple(out)


def to_json(result: BenchResult) -> dict[str, Any]:
    """Returns the result as plain JSON data."""
    return dataclasses.asdict(result)


def table(result: BenchResult) -> Any:
    """Returns a rich table of every row."""
    from rich.markup import escape
    from rich.table import Table
    t = Table(title=f"{result.model} on {result.device} ({result.dtype}), median of "
                    f"{result.rounds} interleaved rounds", caption="\n".join(result.notes))
    for col in ("workload", "attention", "ms", "tok/s", "attn ms", "s", "r", "predicted",
                "gain", "kept", "kernel / fallback"):
        t.add_column(col, justify="left" if col in ("workload", "attention",
                                                      "kernel / fallback") else "right")

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in result.rows:
        name = r.name + (" (base)" if result.base.get(r.workload) == r.name else "")
        calls = "-" if r.stats is None else f"{r.stats['kernel']} / {r.stats['fallback']}" + (
            "".join(f"\n  {n}: {why}" for why, n in r.stats["fallback_reasons"].items()))
        if r.error is not None:
            t.add_row(r.workload, name, "[red]raised[/red]", *("-",) * 7, escape(r.error))
            continue
        t.add_row(r.workload, name, f(r.time_ms, ".2f"), f(r.tokens_per_s, ".0f"),
                  f(r.op_time_ms, ".2f"), f(r.share, ".3f"), f(r.op_speedup, ".3f"),
                  f(r.predicted, ".3f"), f(r.gain, ".3f"), f(r.kept, ".2f"), calls)
    return t


def accuracy_table(result: BenchResult) -> Any:
    """Returns a rich table of each row's accuracy against float32."""
    from rich.table import Table
    t = Table(title="against the float32 model (eager), teacher-forced on one sequence")
    for col in ("attention", "max |logit err|", "top-1 agreement"):
        t.add_column(col, justify="left" if col == "attention" else "right")
    for a in result.accuracy:
        t.add_row(a.name, "raised" if a.max_abs_logit_err is None else
                  f"{a.max_abs_logit_err:.3g}", "-" if a.top1_agreement is None else
                  f"{a.top1_agreement:.4f}")
    return t
