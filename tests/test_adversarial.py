"""Cheating and crashing candidates get a verdict that names the cause; honest ones pass unflagged.

Each candidate in tests/adversarial/ really tries its cheat (SECURITY.md lists the
classes). Every evaluation is a child process (about 5 s on CPU), so evaluators are
shared per module and each candidate is evaluated once. GPU-only classes carry the
`gpu` marker and are skipped, with a reason, where CUDA is absent.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import secrets
from typing import Iterator
from pathlib import Path

import pytest

from evoattn.sandbox import SubprocessEvaluator
from fakes import sandboxed
from evoattn.contract.types import EvalResult, Verdict, geometric_mean

ROOT = Path(__file__).resolve().parents[1]
ADV = ROOT / "tests" / "adversarial"
SEEDS = ROOT / "seeds" / "sdpa"

gpu = pytest.mark.gpu


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


needs_cuda = pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU (run on the H100)")


def read(path: Path, **subs: str) -> str:
    """Returns a candidate's source with __NAME__ placeholders replaced."""
    text = path.read_text()
    for key, val in subs.items():
        text = text.replace(f"__{key}__", val)
    return text


def evaluate(ev: SubprocessEvaluator, path: Path, **subs: str) -> EvalResult:
    return ev.evaluate(read(path, **subs), path.suffix, path.name)


def assert_verdict(result: EvalResult, verdict: Verdict | tuple[Verdict, ...],
                   reason_pattern: str) -> None:
    """Asserts a non-passing verdict (one of several, when given a tuple) whose reason matches
    the pattern (the cause is named)."""
    why = f"{result.verdict.value}: {result.reason}\n--- log tail ---\n{result.log_tail}"
    assert result.verdict in (verdict if isinstance(verdict, tuple) else (verdict,)), why
    assert re.search(reason_pattern, result.reason), why
    assert result.fitness == 0.0


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("evoattn-cache"))


@pytest.fixture(scope="module")
def cpu_eval(cache_dir: str) -> SubprocessEvaluator:
    return sandboxed(device="cpu", cache_dir=cache_dir)


# ---- honest kernels are not flagged ------------------------------------------------------
@pytest.mark.parametrize("path", [SEEDS / "naive_torch.py", SEEDS / "flash_triton.py",
                                  ADV / "honest_torch.py", ADV / "honest_triton.py",
                                  ADV / "honest_makedirs.py", ADV / "honest_prepare.py"],
                         ids=lambda p: p.name)
def test_honest_candidate_passes_without_flags(cpu_eval: SubprocessEvaluator, path: Path) -> None:
    result = evaluate(cpu_eval, path)
    assert result.verdict is Verdict.PASS, f"{result.reason}\n{result.log_tail}"
    assert result.flags == ()
    assert result.fitness > 0


def test_library_attention_passes_under_allow_library_policy(cache_dir: str) -> None:
    ev = sandboxed(device="cpu", cache_dir=cache_dir,
                                          policy="allow-library")
    result = evaluate(ev, ADV / "honest_sdpa.py")
    assert result.verdict is Verdict.PASS, f"{result.reason}\n{result.log_tail}"


# ---- one cheat per candidate, caught with the cause named ---------------------------------
CHEATS = [
    # 1. stale / cached output: right on every correctness call, stale once timed
    ("stale_cache.py", Verdict.INCORRECT, r"timed call \d+ returned a wrong output.*stale"),
    # ... and through what prepare() returns for a key's later calls
    ("stale_prepare.py", Verdict.INCORRECT, r"max abs error|timed call \d+ returned a wrong"),
    # 2. leftover memory: half the output left as whatever torch.empty held. The CPU allocator
    # is not poisoned, so the first call can find a correct answer there by chance (the
    # reference's freed buffer) and the repeat call then returns garbage: nondeterministic.
    ("leftover_memory.py", (Verdict.INCORRECT, Verdict.NONDETERMINISTIC),
     r"NaN or Inf|max abs error|two runs on the same inputs differ"),
    # 3. input tampering
    ("tamper_inputs.py", Verdict.TAMPERING, r"input 2 was modified in place"),
    # 4. work hidden from the timer
    ("thread_pool_leak.py", Verdict.HIDDEN_WORK, r"new OS threads"),
    ("thread_fill.py", Verdict.HIDDEN_WORK,
     r"threads still running after return|output changed after the call returned"),
    ("lazy_subclass.py", Verdict.HIDDEN_WORK, r"lazy output: .*plain torch\.Tensor"),
    ("lazy_when_timed.py", Verdict.HIDDEN_WORK, r"_Lazy from a timed call"),
    # 5. library attention: static scan, runtime tripwires, dispatcher watch, import blocker
    ("sdpa_direct.py", Verdict.POLICY, r"kernel-only policy: torch scaled_dot_product_attention"),
    ("sdpa_getattr.py", Verdict.POLICY, r"called torch scaled_dot_product_attention"),
    ("sdpa_try_fallback.py", Verdict.POLICY, r"called torch scaled_dot_product_attention"),
    ("sdpa_aten_op.py", Verdict.POLICY, r"dispatched library attention op aten\._scaled_dot"),
    ("flash_attn_import.py", Verdict.POLICY, r"imported flash_attn"),
    ("sdpa_when_timed.py", Verdict.POLICY, r"called torch scaled_dot_product_attention"),
    # 6. precision cut in float16: float8 q/k, bfloat16 P
    ("precision_fp8.py", Verdict.INCORRECT, r"max abs error .* > tolerance"),
    ("precision_bf16_p.py", Verdict.INCORRECT, r"max abs error .* > tolerance"),
    # 7. shape specialisation, caught on a domain shape (S = 77)
    ("tail_drop.py", Verdict.INCORRECT, r"\(1,1,77,64\) causal \[domain shape\]: max abs error"),
    # 8. harness tampering by code swap (attribute replacement: its own test below)
    ("tamper_code.py", Verdict.TAMPERING, r"evoattn\.child\.checks\.max_abs_err\.__code__"),
    # ... by swapping the module the harness calls through, or a method of the problem class
    ("tamper_module.py", Verdict.TAMPERING, r"replaced harness functions: evoattn\.child\.checking\.checks"),
    ("tamper_baseline.py", Verdict.TAMPERING, r"evoattn\.problems\.sdpa\.Sdpa\.baseline"),
    ("tamper_types.py", Verdict.TAMPERING, r"evoattn\.contract\.types\.Times\.in_mode"),
    # 10. non-determinism
    ("nondeterministic.py", Verdict.NONDETERMINISTIC, r"two runs on the same inputs differ"),
    # 11. crashes are contained and named
    ("raise_import.py", Verdict.LOAD_ERROR, r"raised at import: RuntimeError"),
    ("raise_call.py", Verdict.CRASH, r"raised ValueError: candidate failed in the call"),
    ("system_exit.py", Verdict.CRASH, r"raised SystemExit"),
    ("raise_when_timed.py", Verdict.CRASH, r"raised while timing: RuntimeError"),
    ("hard_exit.py", Verdict.CRASH, r"exited with code 0 in stage 'check' without a result"),
    ("segfault.py", Verdict.CRASH, r"SIGSEGV in stage 'check'"),
]


@pytest.mark.parametrize("name,verdict,pattern", CHEATS, ids=[c[0] for c in CHEATS])
def test_cheat_is_caught_with_its_cause(cpu_eval: SubprocessEvaluator, name: str,
                                        verdict: Verdict | tuple[Verdict, ...],
                                        pattern: str) -> None:
    assert_verdict(evaluate(cpu_eval, ADV / name), verdict, pattern)


def test_float32_problem_computed_in_bfloat16_is_incorrect(cache_dir: str) -> None:
    ev = sandboxed(device="cpu", cache_dir=cache_dir, dtypes=("float32",))
    result = evaluate(ev, ADV / "precision_bf16.py")
    assert_verdict(result, Verdict.INCORRECT, r"max abs error .* > tolerance")
    assert result.configs[0].dtype == "float32"


def test_slowing_down_the_rival_in_a_duel_is_tampering(cpu_eval: SubprocessEvaluator) -> None:
    rival = read(ADV / "honest_torch.py")
    result = cpu_eval.evaluate(read(ADV / "sabotage_rival.py"), ".py", "sabotage_rival.py",
                               rival=rival)
    assert_verdict(result, Verdict.TAMPERING, r"evoattn_candidate_\d+\.attention")


def test_an_honest_duel_reports_both_programs_and_the_gain(cpu_eval: SubprocessEvaluator) -> None:
    result = cpu_eval.evaluate(read(ADV / "honest_torch.py"), ".py", "honest_torch.py",
                               rival=read(SEEDS / "naive_torch.py"))
    # Behaviour, not a timing: on a loaded machine either program may read faster.
    assert result.verdict is Verdict.PASS, result.reason
    assert result.rival and result.rival_fitness and result.gain and result.gain_ci
    assert result.fitness_ci and result.fitness_ci[0] <= result.fitness <= result.fitness_ci[1]
    assert result.gain_ci[0] <= result.gain <= result.gain_ci[1]
    assert result.configs
    for c in result.configs:
        assert c.times is not None and c.times.call_ms and c.times.call_ms > 0
        assert c.rival_times is not None and c.rival_times.call_ms and c.rival_times.call_ms > 0
        assert c.speedup_ci and c.speedup_ci[0] <= c.speedup <= c.speedup_ci[1]
        assert c.gain and c.gain_ci and c.gain_ci[0] <= c.gain <= c.gain_ci[1]
    # the run's gain is the configs' geometric mean
    assert result.gain == pytest.approx(geometric_mean([c.gain for c in result.configs]))


def test_replacing_clocks_sync_and_checks_is_tampering(cpu_eval: SubprocessEvaluator) -> None:
    result = evaluate(cpu_eval, ADV / "tamper_harness.py")
    assert_verdict(result, Verdict.TAMPERING, r"replaced harness functions")
    for name in ("time.perf_counter", "torch.cuda.synchronize", "torch.cuda.Event.elapsed_time",
                 "evoattn.child.checks.max_abs_err"):
        assert name in result.reason


def test_forged_results_on_stdout_files_and_fds_are_ignored(
        cpu_eval: SubprocessEvaluator) -> None:
    result = evaluate(cpu_eval, ADV / "forge_result.py")
    assert_verdict(result, Verdict.INCORRECT, r"max abs error")
    assert '"fitness": 1000.0' in result.log_tail          # it did print its forgery


# ---- decode: a kernel that reads the cache past cache_seqlens -------------------------------
@pytest.mark.parametrize("extra, verdict", [("1", Verdict.INCORRECT), ("0", Verdict.PASS)],
                         ids=["one_past_the_length", "honest_control"])
def test_decode_reading_past_cache_seqlens_is_incorrect(cache_dir: str, extra: str,
                                                        verdict: Verdict) -> None:
    """The harness writes large garbage past each length, so one key read past it is a wrong
    answer; the same candidate without the off-by-one passes (the control)."""
    ev = sandboxed(problem="decode", device="cpu", cache_dir=cache_dir, check_only=True)
    try:
        src = read(ADV / "decode_past_length.py").replace("EXTRA = 1", f"EXTRA = {extra}")
        result = ev.evaluate(src, ".py", "decode_past_length.py")
    finally:
        ev.close()
    if verdict is Verdict.PASS:
        assert result.verdict is Verdict.PASS, f"{result.reason}\n{result.log_tail}"
    else:
        assert_verdict(result, verdict, r"max abs error .* > tolerance")


# ---- 9. secrets and the sandbox ------------------------------------------------------------
def _tree_contains(root: str, needle: bytes) -> list[str]:
    hits = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                if needle in Path(p).read_bytes():
                    hits.append(p)
            except OSError:
                pass
    return hits


def test_secret_never_reaches_the_candidate(cpu_eval: SubprocessEvaluator, cache_dir: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"sk-evoattn-test-{secrets.token_hex(12)}"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    result = evaluate(cpu_eval, ADV / "snoop_secrets.py")
    assert_verdict(result, Verdict.SANDBOX, r"read another process's /proc/\d+/environ")
    assert "no-key-in-env" in result.log_tail            # it looked, and found nothing
    assert secret not in json.dumps(result.to_json())
    assert secret not in result.log_tail
    assert _tree_contains(cache_dir, secret.encode()) == []


def test_writes_outside_the_temp_dir_are_refused(cpu_eval: SubprocessEvaluator) -> None:
    token = secrets.token_hex(8)
    targets = [f"/tmp/evoattn_escape_{token}{s}" for s in ("", "_renamed", "_dir")]
    try:
        result = evaluate(cpu_eval, ADV / "escape_write.py", TOKEN=token)
        assert_verdict(result, Verdict.SANDBOX, r"wrote outside its directory: /tmp/evoattn_escape")
        assert [t for t in targets if os.path.exists(t)] == []
    finally:
        for t in targets:
            if os.path.isdir(t):
                os.rmdir(t)
            elif os.path.exists(t):
                os.remove(t)


def test_spawning_processes_is_refused(cpu_eval: SubprocessEvaluator) -> None:
    token = secrets.token_hex(8)
    targets = [f"/tmp/evoattn_escape_{token}_{s}" for s in ("subprocess", "system", "libc")]
    try:
        result = evaluate(cpu_eval, ADV / "spawn_process.py", TOKEN=token)
        assert_verdict(result, Verdict.SANDBOX, r"spawned a process: 'sh'")
        assert [t for t in targets if os.path.exists(t)] == []
    finally:
        for t in targets:
            if os.path.exists(t):
                os.remove(t)


# ---- 11. resource exhaustion is contained ---------------------------------------------------
def test_host_memory_hog_is_killed(cache_dir: str) -> None:
    ev = sandboxed(device="cpu", cache_dir=cache_dir,
                                          max_host_mem_bytes=3 * 2 ** 29)   # 1.5 GiB
    assert_verdict(evaluate(ev, ADV / "memory_hog.py"), Verdict.OOM, r"host memory .* over the limit")


def test_hang_times_out_and_the_next_candidate_still_passes(cache_dir: str) -> None:
    ev = sandboxed(device="cpu", cache_dir=cache_dir, run_timeout_s=20)
    assert_verdict(evaluate(ev, ADV / "hang.py"), Verdict.TIMEOUT,
                   r"timed out in stage 'check' \(limit 20 s\)")
    after = evaluate(ev, SEEDS / "naive_torch.py")
    assert after.verdict is Verdict.PASS, after.reason


# ---- 12. implausible speed: the rule itself, with a fake timer --------------------------------
# No honest CPU candidate is 10x faster than SDPA (call overhead alone is ~1/3 of SDPA's time
# at S = 1), so the flag-and-re-verify path is driven with a timer that reports any speed we ask.
class _FakeTimer:
    def __init__(self, candidate_ms: float, baseline_ms: float, kept_out=None) -> None:  # noqa: ANN001
        self.ms = {"candidate": candidate_ms, "baseline": baseline_ms}
        self.kept_out = kept_out            # a timed output to hand back for re-checking

    def measure(self, fns, inputs, random_names, refill, plan, keep, rng, *_, **__):  # noqa: ANN001, ANN002, ANN003
        from evoattn.child.timing import Kept, Measurement
        from evoattn.contract.types import Times
        names = list(fns)
        ms = {n: self.ms["candidate" if n == "candidate" else "baseline"] for n in names}
        kept = [] if self.kept_out is None else [Kept("timed call 0", self.kept_out, dict(inputs))]
        return Measurement(times={n: Times(kernel_ms=v, call_ms=v, host_us=v * 1e3)
                                  for n, v in ms.items()},
                           kept=kept, peak_mem_bytes={n: None for n in names},
                           host_ms_per_call=dict(ms), launch_ms={})


def _load_entry(path: Path):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(f"adv_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.attention


def _time_with(entry, candidate_ms: float, ceiling: float | None = None,  # noqa: ANN001, ANN202
               kept_out=None, torch_err: float | None = None, device: str = "cuda"):  # noqa: ANN001
    """Runs the harness's timing step for one CPU config with a fake timer; returns (result, flags).

    The request says `device` (the implausibility rule is a GPU rule; the tensors stay on the
    CPU). kept_out: a timed output the fake timer hands back; torch_err: overrides torch's error
    measured in the correctness pass (and so the bound)."""
    import torch

    from evoattn.child.cases import prepare_case
    from evoattn.child.measure import TimingContext, time_case
    from evoattn.problems import get_problem
    from evoattn.contract.request import EvalRequest
    from evoattn.contract.types import ConfigResult

    problem = get_problem("sdpa")
    cfg = dict(problem.cpu_configs[0])
    rng = random.Random(1234)
    case = prepare_case(problem, cfg, False, torch.float16, torch.device("cpu"), rng, 1,
                        problem.tolerance)
    if torch_err is not None:
        case.torch_err = torch_err
        case.bound = problem.tolerance.bound(torch_err)
    run = lambda inputs, c: problem.call(entry, inputs, c)  # noqa: E731
    run(case.trials[0].inputs, cfg)                         # the correctness pass calls it first
    flags: list[str] = []
    checked = ConfigResult(cfg, "float16", Verdict.PASS, "", 0.0, case.bound)
    ctx = TimingContext(problem, EvalRequest(device=device, timing="kernel"),
                        _FakeTimer(candidate_ms, 1.0, kept_out), problem.tolerance, "float16",
                        None, ceiling, {"sdpa": problem.baseline}, {})
    return time_case(ctx, case, run, rng, checked, flags), flags


def test_implausibly_fast_correct_candidate_is_flagged_and_reverified() -> None:
    out, flags = _time_with(_load_entry(ADV / "honest_torch.py"), candidate_ms=0.01)
    assert out.verdict is Verdict.PASS and out.speedup == pytest.approx(100.0)
    assert len(flags) == 1 and "implausible 100.0x" in flags[0] and "re-verified" in flags[0]


def test_implausibly_fast_candidate_wrong_on_fresh_inputs_is_implausible() -> None:
    from evoattn.child.checking import Fail
    with pytest.raises(Fail) as info:
        _time_with(_load_entry(ADV / "stale_cache.py"), candidate_ms=0.01)
    assert info.value.verdict is Verdict.IMPLAUSIBLE
    assert "wrong on fresh inputs" in info.value.reason


def test_speed_above_the_measured_ceiling_is_implausible() -> None:
    from evoattn.child.checking import Fail
    with pytest.raises(Fail) as info:
        _time_with(_load_entry(ADV / "honest_torch.py"), candidate_ms=0.5, ceiling=1e-6)
    assert info.value.verdict is Verdict.IMPLAUSIBLE
    assert "exceeds the measured ceiling" in info.value.reason


def test_reverification_bound_counts_torch_error_on_the_fresh_inputs() -> None:
    # The correctness pass saw torch err 0 (bound = the 1e-5 floor); fresh float16 inputs give
    # torch itself ~1e-3 of error, so the honest candidate must still pass re-verification.
    out, flags = _time_with(_load_entry(ADV / "honest_torch.py"), candidate_ms=0.01,
                            torch_err=0.0)
    assert out.verdict is Verdict.PASS and len(flags) == 1


def test_empty_timed_output_is_incorrect() -> None:
    import torch

    from evoattn.child.checking import Fail
    with pytest.raises(Fail) as info:      # max_abs_err of an empty tensor is 0: shape first
        _time_with(_load_entry(ADV / "honest_torch.py"), candidate_ms=0.5,
                   kept_out=torch.empty(0, dtype=torch.float16))
    assert info.value.verdict is Verdict.INCORRECT
    assert "timed call 0 returned a wrong output (output shape (0,)" in info.value.reason


def test_ordinary_speed_is_not_flagged() -> None:
    out, flags = _time_with(_load_entry(ADV / "honest_torch.py"), candidate_ms=0.5)
    assert out.verdict is Verdict.PASS and flags == []


def test_cpu_timings_are_never_called_implausible() -> None:
    # A CPU speedup (the interpreter or plain torch against PyTorch's CPU kernels) says nothing
    # about physics: 100x on the CPU is neither flagged nor re-verified.
    out, flags = _time_with(_load_entry(ADV / "honest_torch.py"), candidate_ms=0.01,
                            device="cpu")
    assert out.verdict is Verdict.PASS and out.speedup == pytest.approx(100.0) and flags == []


# ---- GPU-only classes (run by the lead on an H100) -----------------------------------------
GPU_CONFIGS = ({"B": 2, "H": 4, "S": 512, "D": 64, "causal": False},
               {"B": 2, "H": 4, "S": 512, "D": 64, "causal": True})


@pytest.fixture(scope="module", params=["fresh", "spare"])
def gpu_eval(cache_dir: str, request: pytest.FixtureRequest) -> Iterator[SubprocessEvaluator]:
    """A fresh child per candidate (`evoattn eval`), or a run's spare children, set up before
    they are told their candidate."""
    ev = sandboxed(device="cuda", cache_dir=cache_dir, configs=GPU_CONFIGS, reps=20, warmup=3,
                   spare=request.param == "spare")
    yield ev
    ev.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("path", [SEEDS / "naive_torch.py", SEEDS / "flash_triton.py",
                                  SEEDS / "naive.cu", ADV / "honest_triton.py"],
                         ids=lambda p: p.name)
def test_honest_candidate_passes_on_gpu(gpu_eval: SubprocessEvaluator, path: Path) -> None:
    result = evaluate(gpu_eval, path)
    assert result.verdict is Verdict.PASS, f"{result.reason}\n{result.log_tail}"
    assert result.flags == ()


GPU_CHEATS = [
    ("gpu_side_stream.py", Verdict.HIDDEN_WORK, r"output changed after the call returned|"
                                                r"work escaped the timer"),
    ("leftover_memory.py", Verdict.INCORRECT, r"NaN or Inf|max abs error"),  # NaN-poisoned
    ("stale_cache.py", Verdict.INCORRECT, r"stale or cached"),
    ("gpu_oom.py", Verdict.OOM, r"out of memory"),
    ("gpu_oob.cu", Verdict.CRASH, r"illegal memory access|CUDA error|error code|SIG"),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("name,verdict,pattern", GPU_CHEATS, ids=[c[0] for c in GPU_CHEATS])
def test_gpu_cheat_is_caught_with_its_cause(gpu_eval: SubprocessEvaluator, name: str,
                                            verdict: Verdict, pattern: str) -> None:
    assert_verdict(evaluate(gpu_eval, ADV / name), verdict, pattern)


@gpu
@needs_cuda
def test_side_stream_work_cannot_hide_behind_the_timer_spin(gpu_eval: SubprocessEvaluator
                                                             ) -> None:
    """The side work (a ~0.2 ms sleep, then the math) is timed: the spin holds every SM, so
    the work cannot run before the start event. With a one-thread spin it hid (SECURITY.md)."""
    result = evaluate(gpu_eval, ADV / "gpu_side_stream_hidden.py")
    assert result.verdict is Verdict.PASS, f"{result.reason}\n{result.log_tail}"
    assert result.configs and all(c.ms is not None and c.ms >= 0.15 for c in result.configs), \
        [(c.params, c.ms) for c in result.configs]


@gpu
@needs_cuda
def test_a_triton_launch_hook_cannot_start_work_before_the_timer(gpu_eval: SubprocessEvaluator
                                                                  ) -> None:
    """The spin is replayed from a CUDA graph, so the candidate's Triton launch hook never
    fires before a timed call: it is timed computing honestly (no near-zero time, no flag)."""
    result = evaluate(gpu_eval, ADV / "gpu_spin_hook.py")
    assert result.verdict is Verdict.PASS, f"{result.reason}\n{result.log_tail}"
    assert result.flags == (), result.flags
    assert result.configs and all(c.ms is not None and c.ms >= 0.01 for c in result.configs), \
        [(c.params, c.ms) for c in result.configs]


# ---- the static scan: comments and docstrings aside, never code -----------------------------

def test_static_scan_ignores_comments_and_docstrings() -> None:
    from evoattn.child.guards import scan_source
    src = ('"""Faster than F.scaled_dot_product_attention."""\n'
           "def attention(q, k, v, causal=False, scale=None):\n"
           '    """Not scaled_dot_product_attention: a kernel of our own."""\n'
           "    return q  # was F.scaled_dot_product_attention(q, k, v)\n")
    assert scan_source(src) == []


def test_static_scan_sees_code_that_shares_a_line_with_a_docstring() -> None:
    from evoattn.child.guards import scan_source
    src = ("import torch.nn.functional as F\n"
           'def attention(q, k, v, causal=False, scale=None): "doc"; '
           "return F.scaled_dot_product_attention(q, k, v)\n")
    assert scan_source(src) == ["torch scaled_dot_product_attention "
                                "('scaled_dot_product_attention' at line 2)"]
