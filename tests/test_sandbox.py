"""The parent side of the evaluator boundary: environment scrub, framing, death classification.

These run without a child except the last two tests, which each start one (~3 s on CPU).
"""
from __future__ import annotations

import dataclasses
import json
import signal
import os
import tempfile
from pathlib import Path

import pytest

from evoattn import childenv, sandbox, watch
from evoattn.childenv import child_env, detect_target
from fakes import sandboxed
from evoattn.contract.types import Verdict

ROOT = Path(__file__).resolve().parents[1]


def test_child_env_drops_secrets_and_keeps_the_allow_list() -> None:
    parent = {"PATH": "/usr/bin", "OPENAI_API_KEY": "sk-1", "CUDA_HOME": "/cuda",
              "HF_TOKEN": "hf-1", "AWS_SECRET_ACCESS_KEY": "a", "TORCH_AUTH_TOKEN": "t",
              "MY_PRIVATE_THING": "p", "HOME": "/root", "RANDOM_VAR": "x", "LANG": "C.UTF-8"}
    env = child_env(parent, "/work/dir", "/cache", "cuda")
    assert env["PATH"] == "/usr/bin" and env["CUDA_HOME"] == "/cuda" and env["LANG"] == "C.UTF-8"
    for name in ("OPENAI_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "TORCH_AUTH_TOKEN",
                 "MY_PRIVATE_THING", "RANDOM_VAR"):
        assert name not in env
    assert env["HOME"] == env["TMPDIR"] == "/work/dir"


def test_child_env_drops_named_secrets_even_on_the_allow_list() -> None:
    env = child_env({"TRITON_SPECIAL": "s"}, "/w", "/c", "cpu", extra_secret_names=("TRITON_SPECIAL",))
    assert "TRITON_SPECIAL" not in env


def test_cpu_child_runs_triton_interpreted_with_no_gpu_visible() -> None:
    env = child_env({}, "/w", "/c", "cpu")
    assert env["TRITON_INTERPRET"] == "1" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert "TRITON_INTERPRET" not in child_env({"TRITON_INTERPRET": "1"}, "/w", "/c", "cuda")


def test_messages_without_the_nonce_are_ignored() -> None:
    nonce = "ab" * 16
    good = json.dumps({"nonce": nonce, "type": "result", "payload": {}}).encode()
    assert watch.parse(good, nonce)["type"] == "result"
    assert watch.parse(json.dumps({"nonce": "0" * 32, "type": "result"}).encode(), nonce) is None
    assert watch.parse(json.dumps({"type": "result", "payload": {}}).encode(), nonce) is None
    assert watch.parse(b"not json", nonce) is None
    assert watch.parse(b"[1, 2]", nonce) is None


@pytest.mark.parametrize("code,tail,verdict,fragment", [
    (-signal.SIGSEGV, "", Verdict.CRASH, "SIGSEGV in stage 'check'"),
    (-signal.SIGKILL, "", Verdict.CRASH, "SIGKILL"),
    (1, "torch.OutOfMemoryError: CUDA out of memory", Verdict.OOM, "out of memory"),
    (0, "last words", Verdict.CRASH, "exited with code 0 in stage 'check' without a result: last"),
])
def test_child_death_is_classified(code: int, tail: str, verdict: Verdict, fragment: str) -> None:
    got, reason = watch.classify_death(code, tail, "check")
    assert got is verdict and fragment in reason


def test_work_dir_is_removed_after_each_evaluation(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
    ev = sandboxed(device="cpu", cache_dir=str(tmp_path))
    result = ev.evaluate("raise RuntimeError('at import')\n", ".py", "broken")
    assert result.verdict is Verdict.LOAD_ERROR and "at import" in result.reason
    assert result.candidate == "broken"
    work = [d for d in made if "zygote" not in d]
    assert work and not any(os.path.exists(d) for d in work)
    ev.close()                                  # and the zygote's own directory goes too
    assert not any(os.path.exists(d) for d in made)


def test_a_missing_entry_point_is_a_load_error(tmp_path) -> None:  # noqa: ANN001
    ev = sandboxed(device="cpu", cache_dir=str(tmp_path))
    result = ev.evaluate("import torch\n\ndef not_attention(q, k, v):\n    return q\n", ".py")
    assert result.verdict is Verdict.LOAD_ERROR and "defines no function attention" in result.reason


def test_zygote_and_fresh_interpreter_give_the_same_verdicts(tmp_path) -> None:  # noqa: ANN001
    ok = "import torch\n\ndef attention(q, k, v, causal=False, scale=None):\n    return q\n"
    for zygote in (True, False):
        ev = sandboxed(device="cpu", cache_dir=str(tmp_path),
                                              zygote=zygote)
        try:
            assert ev.evaluate(ok, ".py").verdict is Verdict.INCORRECT
            r = ev.evaluate("import os\nos._exit(3)\n", ".py")
            assert r.verdict is Verdict.CRASH and "code 3" in r.reason
            assert (ev._zygote is not None) is zygote
        finally:
            ev.close()


def test_stage_seconds_splits_the_wall_time_between_reported_stages() -> None:
    marks = [("start", 0.0), ("build", 1.0), ("reference", 1.5), ("check", 4.0), ("check", 5.0)]
    assert watch.stage_seconds(marks, 10.0) == {"start": 1.0, "build": 0.5,
                                                    "reference": 2.5, "check": 6.0}


def test_an_evaluation_reports_where_its_time_went(tmp_path) -> None:  # noqa: ANN001
    ok = ("import torch\n\ndef attention(q, k, v, causal=False, scale=None):\n"
          "    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,"
          " scale=scale)\n")
    ev = sandboxed(device="cpu", cache_dir=str(tmp_path),
                                          policy="allow-library", reps=2, warmup=1)
    try:
        r = ev.evaluate(ok, ".py")
    finally:
        ev.close()
    assert r.verdict is Verdict.PASS, r.reason
    assert {"start", "build", "reference", "load", "check", "time"} <= r.stage_s.keys()
    assert all(v >= 0 for v in r.stage_s.values())
    assert sum(r.stage_s.values()) <= r.duration_s + 0.05
    assert sum(r.stage_s.values()) > 0.5 * r.duration_s
    assert r.from_json(r.to_json()).stage_s == r.stage_s


def test_a_zygote_child_makes_temp_files_in_its_own_directory(tmp_path) -> None:  # noqa: ANN001
    # Triton writes its launcher sources with tempfile; an import in the zygote had cached the
    # zygote's TMPDIR, so every forked candidate wrote outside its own directory.
    src = ("import tempfile\nimport torch\n\n"
           "def attention(q, k, v, causal=False, scale=None):\n"
           "    tempfile.mkdtemp()\n"
           "    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,"
           " scale=scale)\n")
    ev = sandboxed(device="cpu", cache_dir=str(tmp_path), zygote=True,
                                          policy="allow-library", reps=2, warmup=1)
    try:
        r = ev.evaluate(src, ".py")
        assert ev._zygote is not None
    finally:
        ev.close()
    assert r.verdict is Verdict.PASS, r.reason


def test_cost_summary_averages_each_stage_over_the_evaluations() -> None:
    from evoattn.contract.types import EvalResult
    from evoattn.report import cost_summary
    rs = [EvalResult(Verdict.PASS, "", 1.0, duration_s=d,
                     stage_s={"reference": ref, "check": 1.0, "time": 0.5, "load": 0.0})
          for d, ref in ((6.0, 4.0), (10.0, 8.0))]
    line = cost_summary(rs + [EvalResult(Verdict.CRASH, "no stages", 0.0)])
    assert line == "evaluations: 2, 8.0 s each on average (reference 6.0, check 1.0, time 0.5, load 0.0)"
    assert cost_summary([]) == ""


@pytest.mark.parametrize("output,want", [("9.0\n", "sm90"), ("9.0\n9.0\n", "sm90"),
                                         ("8.0\n", "sm80"), ("9.0\n8.0\n", None),
                                         ("[N/A]\n", None)])
def test_the_target_fact_comes_from_nvidia_smi(tmp_path, monkeypatch, output, want) -> None:  # noqa: ANN001
    smi = tmp_path / "nvidia-smi"                      # a real program on PATH, as on a GPU box
    smi.write_text(f"#!/bin/sh\nprintf '{output.replace(chr(10), chr(92) + 'n')}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_target("cuda") == want
    assert detect_target("cpu") == "cpu"


def test_without_nvidia_smi_there_is_no_target_fact(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_target("cuda") is None


def test_a_request_round_trips_through_json_with_its_dtypes() -> None:
    from evoattn.contract.request import EvalRequest
    req = EvalRequest(device="cpu", configs=({"B": 1, "H": 2, "S": 64, "D": 64, "causal": True},),
                      dtypes=("bfloat16", "float16"), allowed_dirs=("/a",), facts={"t": "cpu"})
    back = EvalRequest.from_json(json.loads(json.dumps(req.to_json())))
    assert back == req and back.dtypes == ("bfloat16", "float16")
    assert back.dtype == "bfloat16"                              # the timed one: the first
    assert back.resolved_dtypes("float16") == ("bfloat16", "float16")
    plain = EvalRequest.from_json(json.loads(json.dumps(EvalRequest().to_json())))
    assert plain.dtypes is None and plain.dtype is None
    assert plain.resolved_dtypes("float32") == ("float32",)


@pytest.mark.parametrize("dtypes, message", [
    (("float16", "fp8"), "dtype must be one of float16, bfloat16, float32, got 'fp8'"),
    ((), "dtypes must name at least one dtype"),
    (("float16", "float16"), "dtypes name one dtype twice"),
])
def test_a_request_with_bad_dtypes_is_refused(dtypes: tuple, message: str) -> None:
    from evoattn.contract.request import EvalRequest
    with pytest.raises(ValueError, match=message):
        EvalRequest(dtypes=dtypes).validate()


def test_a_candidate_wrong_in_one_of_its_dtypes_is_incorrect_naming_it(tmp_path) -> None:  # noqa: ANN001
    from pathlib import Path
    src = (Path(__file__).parent / "candidates" / "bf16_as_fp16_bits.py").read_text()
    cfg = ({"B": 1, "H": 2, "S": 64, "D": 64, "causal": False},)
    both = sandboxed(device="cpu", cache_dir=str(tmp_path), configs=cfg, trials=1,
                     dtypes=("float16", "bfloat16"), check_only=True)
    half = sandboxed(device="cpu", cache_dir=str(tmp_path), configs=cfg, trials=1,
                     dtypes=("float16",), check_only=True)
    try:
        wrong = both.evaluate(src, ".py")
        right = half.evaluate(src, ".py")
    finally:
        both.close()
        half.close()
    assert wrong.verdict is Verdict.INCORRECT
    assert wrong.reason.startswith("bfloat16: (1,2,64,64): max abs error"), wrong.reason
    assert wrong.configs[0].dtype == "bfloat16" and wrong.dtypes == ("float16", "bfloat16")
    assert right.verdict is Verdict.PASS, right.reason
    assert right.dtypes == ("float16",) and right.configs[0].dtype == "float16"


_OK = ("import torch\n\ndef attention(q, k, v, causal=False, scale=None):\n"
       "    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,"
       " scale=scale)\n")


def test_a_child_sets_up_its_baselines_then_waits_for_its_turn_on_a_shared_gpu(
        tmp_path) -> None:  # noqa: ANN001
    import fcntl
    import threading
    import time
    lock = tmp_path / "locks" / "gpu-0.lock"
    lock.parent.mkdir()
    held = open(lock, "a+")
    fcntl.flock(held.fileno(), fcntl.LOCK_EX)           # another evaluation's turn
    ev = sandboxed(device="cpu", cache_dir=str(tmp_path / "cache"), policy="allow-library",
                   reps=2, warmup=1, gpu_lock=str(lock))
    out: list = []
    t = threading.Thread(target=lambda: out.append(ev.evaluate(_OK, ".py")))
    quiet = str(lock) + ".quiet"

    def quiet_free() -> bool:
        with open(quiet, "a+") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True
    try:
        t.start()
        until = time.monotonic() + 60
        while quiet_free() and time.monotonic() < until:     # its set-up begins ...
            time.sleep(0.01)
        while not quiet_free() and time.monotonic() < until:     # ... and ends
            time.sleep(0.01)
        time.sleep(3.0)
        assert t.is_alive() and not out, "the child went on while the lock was held"
        fcntl.flock(held.fileno(), fcntl.LOCK_UN)
        t.join(timeout=120)
    finally:
        held.close()
        ev.close()
    r = out[0]
    assert r.verdict is Verdict.PASS, r.reason
    order = list(r.stage_s)      # its references are set-up too: made before its turn
    assert order.index("baselines") < order.index("reference") < order.index("gpu-wait") < \
        order.index("load")
    assert r.stage_s["gpu-wait"] > 2.0
    assert sandbox.run_deadline(r, 10.0, 1.0, 1e9) == pytest.approx(
        10 * sum(v for k, v in r.stage_s.items() if k not in ("start", "build", "gpu-wait")))


def test_a_turn_that_never_comes_is_an_evaluator_fault_not_a_verdict(
        tmp_path, monkeypatch) -> None:  # noqa: ANN001
    import fcntl
    monkeypatch.setattr(childenv, "GPU_WAIT_SLACK_S", 0.0)
    lock = tmp_path / "gpu.lock"
    held = open(lock, "a+")
    fcntl.flock(held.fileno(), fcntl.LOCK_EX)
    ev = sandboxed(device="cpu", cache_dir=str(tmp_path / "cache"), policy="allow-library",
                   reps=2, warmup=1, gpu_lock=str(lock), run_timeout_s=2.0)
    try:
        r = ev.evaluate(_OK, ".py")
    finally:
        held.close()
        ev.close()
    assert r.verdict is Verdict.EVALUATOR_FAULT
    assert "for its turn on the GPU" in r.reason and r.reason.startswith("twice")


def test_a_plain_candidate_takes_the_run_s_looser_protocol_and_a_duel_the_request_s(
        tmp_path) -> None:  # noqa: ANN001
    from evoattn.contract.request import EvalRequest
    ev = sandbox.SubprocessEvaluator(EvalRequest(device="cpu"),
                                     sandbox.SandboxSettings(cache_dir=str(tmp_path)),
                                     plain={"width": 0.02, "graph": False, "heat": False})
    seen: list = []
    ev._run_child = lambda req, work, spare: (seen.append(req), (  # type: ignore[method-assign]
        sandbox.EvalResult.failure(Verdict.CRASH, "not run"), {}))[1]
    ev.evaluate("x = 1\n", ".py")
    ev.evaluate("x = 1\n", ".py", rival="x = 2\n")
    assert (seen[0].width, seen[0].graph, seen[0].heat, seen[0].rival) == \
        (0.02, False, False, "")
    assert (seen[1].width, seen[1].graph, seen[1].heat) == (0.01, True, True) and seen[1].rival


def test_slots_sharing_a_gpu_lock_one_file_per_gpu_and_only_on_the_gpu(tmp_path) -> None:  # noqa: ANN001
    from evoattn.contract.request import EvalRequest
    share = sandbox.SandboxSettings(cache_dir=str(tmp_path), visible_device="3", gpu_share=2)
    gpu = sandbox.SubprocessEvaluator(EvalRequest(device="cuda"), share)
    assert gpu.request.gpu_lock == os.path.join(str(tmp_path), "gpu-locks", "gpu-3.lock")
    alone = sandbox.SubprocessEvaluator(EvalRequest(device="cuda"),
                                        sandbox.SandboxSettings(cache_dir=str(tmp_path),
                                                                visible_device="3"))
    cpu = sandbox.SubprocessEvaluator(EvalRequest(device="cpu"),
                                      sandbox.SandboxSettings(cache_dir=str(tmp_path),
                                                              gpu_share=2))
    assert alone.request.gpu_lock == "" and cpu.request.gpu_lock == ""
    assert share.gpu_wait_s(60.0) == 60.0 + childenv.GPU_WAIT_SLACK_S
    assert dataclasses.replace(share, gpu_share=3).gpu_wait_s(60.0) == 2 * share.gpu_wait_s(60.0)


def test_the_seed_s_measured_ceiling_serves_every_later_child(tmp_path) -> None:  # noqa: ANN001
    from evoattn.contract.request import EvalRequest
    ev = sandbox.SubprocessEvaluator(EvalRequest(device="cuda"), sandbox.SandboxSettings(
        cache_dir=str(tmp_path), run_factor=10.0, run_floor_s=1.0))
    seed = sandbox.EvalResult(Verdict.PASS, "ok", 1.0, (), stage_s={"time": 2.0},
                              device_info={"measured_matmul_tflops": 712.5})
    ev.calibrate(seed)
    assert ev.request.ceiling_tflops == 712.5 and ev.request.run_timeout_s == 20.0


def test_the_station_times_baselines_by_the_plain_candidates_protocol(tmp_path) -> None:  # noqa: ANN001
    """The station serves plain candidates only (a duel times its own baselines): its request
    takes their fields, here no heat, as theirs does."""
    from evoattn.contract.request import EvalRequest
    ev = sandbox.SubprocessEvaluator(
        EvalRequest(device="cuda"),
        sandbox.SandboxSettings(cache_dir=str(tmp_path), station_refresh_s=60.0),
        plain={"width": 0.02, "graph": False, "heat": False})
    try:
        assert ev._station is not None and ev._station._proc is None     # starts on first use
        assert (ev._station.request.heat, ev._station.request.width) == (False, 0.02)
        assert ev.request.heat is True                                   # duels keep it
    finally:
        ev.close()


def _sdpa_candidate(at_import: str = "", in_call: str = "") -> str:
    """An honest candidate (SDPA under allow-library) with lines of its own at import and at
    the top of each call."""
    return ("import torch\n" + at_import + "\n\ndef attention(q, k, v, causal=False, "
            "scale=None):\n" + in_call + "    return torch.nn.functional."
            "scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)\n")


def _spared(tmp_path, **request) -> sandbox.SubprocessEvaluator:  # noqa: ANN001, ANN003
    return sandboxed(device="cpu", cache_dir=str(tmp_path / "cache"), policy="allow-library",
                     reps=2, warmup=1, spare=True, **request)


def test_a_spare_child_sets_up_the_next_evaluation_before_its_candidate_is_named(
        tmp_path) -> None:  # noqa: ANN001
    """A run's slot keeps a spare: forked while one candidate is evaluated, it makes its
    inputs, references and baselines' plans, then evaluates the next candidate it is told,
    with the same verdicts as a fresh child; closing the evaluator ends it."""
    ev = _spared(tmp_path)
    wrong = "import torch\n\ndef attention(q, k, v, causal=False, scale=None):\n    return q\n"
    try:
        first = ev.evaluate(_OK, ".py")
        assert first.verdict is Verdict.PASS, first.reason
        assert "reference" in first.stage_s                    # set up in its own time
        assert len(ev._spare_queue) == sandbox.SPARES      # one forked at its start, one after
        spare = ev._spare_queue[0]                         # its timing
        assert spare.child.returncode() is None
        assert spare.template.gpu_lock and ev.request.gpu_lock == spare.template.gpu_lock
        second = ev.evaluate(_OK, ".py")
        assert second.verdict is Verdict.PASS, second.reason
        assert not {"baselines", "reference"} & second.stage_s.keys(), second.stage_s
        assert spare.closed and not os.path.exists(spare.work)   # used once, then gone
        assert ev.evaluate(wrong, ".py").verdict is Verdict.INCORRECT
        last = ev._spare_queue[-1]
        assert spare not in ev._spare_queue
    finally:
        ev.close()
    assert not _running(last.child.pid) and not os.path.exists(last.work)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_spare_set_up_for_another_request_or_dead_is_not_used(tmp_path) -> None:  # noqa: ANN001
    import time
    from evoattn.contract.request import EvalRequest
    base = EvalRequest(device="cpu", secret_seed=7)
    assert base.same_set_up(dataclasses.replace(base, width=0.02, graph=False, candidate="x"))
    for change in ({"trials": 2}, {"secret_seed": 8}, {"dtypes": ("bfloat16",)},
                   {"baseline_times": {}}):
        assert not base.same_set_up(dataclasses.replace(base, **change)), change
    ev = _spared(tmp_path)
    try:
        assert ev.evaluate(_OK, ".py").verdict is Verdict.PASS
        stale = ev._spare_queue[0]
        ev.request = dataclasses.replace(ev.request, trials=2)   # set up with 3 trials
        r = ev.evaluate(_OK, ".py")
        assert r.verdict is Verdict.PASS and "reference" in r.stage_s
        assert stale.closed and not _running(stale.child.pid)
        dead = list(ev._spare_queue)
        for spare in dead:
            os.kill(spare.child.pid, signal.SIGKILL)
        until = time.monotonic() + 20
        while any(_running(sp.child.pid) for sp in dead) and time.monotonic() < until:
            time.sleep(0.05)
        r = ev.evaluate(_OK, ".py")
        assert r.verdict is Verdict.PASS and "reference" in r.stage_s, r.reason
        assert not r.flags                       # a fresh child at once, no fault and retry
    finally:
        ev.close()


def test_spares_gone_with_their_zygote_between_candidates_are_not_waited_for(
        tmp_path) -> None:  # noqa: ANN001
    """The zygote killed from outside between two candidates takes its spares with it (and
    reports no exits): the next candidate starts on a new zygote at once, not at a deadline."""
    import time
    ev = _spared(tmp_path)
    try:
        assert ev.evaluate(_OK, ".py").verdict is Verdict.PASS
        spares = list(ev._spare_queue)
        os.kill(ev._zygote.proc.pid, signal.SIGKILL)
        until = time.monotonic() + 20
        while any(_running(sp.child.pid) for sp in spares) and time.monotonic() < until:
            time.sleep(0.05)
        t0 = time.monotonic()
        r = ev.evaluate(_OK, ".py")
        assert r.verdict is Verdict.PASS and "reference" in r.stage_s, r.reason
        assert not r.flags                       # not an evaluator fault, evaluated again
        assert time.monotonic() - t0 < 15 and all(sp.closed for sp in spares)   # no waits
    finally:
        ev.close()


def test_a_spare_whose_set_up_fails_is_replaced_not_blamed_on_a_candidate(
        tmp_path, monkeypatch) -> None:  # noqa: ANN001
    import time
    from evoattn.contract.types import SPARE_UNPREPARED
    ev = _spared(tmp_path)
    real = ev._spare_template
    monkeypatch.setattr(ev, "_spare_template", lambda: dataclasses.replace(
        real(), problem=str(tmp_path / "no_such_problem.py")))
    try:
        assert ev.evaluate(_OK, ".py").verdict is Verdict.PASS
        until = time.monotonic() + 60
        while any(b.child.returncode() is None for b in ev._spare_queue) and \
                time.monotonic() < until:
            time.sleep(0.05)
        assert [b.child.returncode() for b in ev._spare_queue] == [SPARE_UNPREPARED] * 2
        r = ev.evaluate(_OK, ".py")
        assert r.verdict is Verdict.PASS and "reference" in r.stage_s, r.reason
    finally:
        ev.close()


def test_a_spare_dies_with_the_tool_however_it_ends(tmp_path) -> None:  # noqa: ANN001
    """SIGKILL of the parent while its spare waits for a candidate: nothing stays."""
    import subprocess
    import sys
    import time
    script = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
              "from fakes import sandboxed\n"
              f"ev = sandboxed(device='cpu', cache_dir={str(tmp_path / 'cache')!r}, "
              "policy='allow-library', reps=2, warmup=1, spare=True)\n"
              f"print(ev.evaluate({_OK!r}, '.py').verdict.value, ev._spare_queue[0].child.pid, "
              "ev._zygote.proc.pid, flush=True)\n"
              "import time; time.sleep(600)\n")
    left = tmp_path / "tmp"            # what a killed tool cannot remove stays in the test's
    left.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=str(left)))
    try:
        verdict, spare, zygote = proc.stdout.readline().split()
        assert verdict == "pass" and _running(int(spare)) and _running(int(zygote))
    finally:
        proc.kill()
        proc.wait()
    until = time.monotonic() + 20
    while (_running(int(spare)) or _running(int(zygote))) and time.monotonic() < until:
        time.sleep(0.1)
    assert not _running(int(spare)) and not _running(int(zygote))


def test_a_spare_s_candidate_finds_no_request_or_channel_left_in_its_directory(
        tmp_path) -> None:  # noqa: ANN001
    """The spare read its set-up request (with the secret seed of its inputs) and its
    candidate's request at once, and removed both files and the go FIFO (its result FIFO is
    the process's own fd 3 anyway)."""
    probe = _sdpa_candidate(
        at_import="import os\n"
                  "left = [os.path.join(d, f) for d, _, fs in os.walk('.') for f in fs\n"
                  "        if f.endswith('.json') or f == 'go.fifo']\n"
                  "if left:\n    raise RuntimeError(f'left behind: {left}')\n")
    ev = _spared(tmp_path)
    try:
        ev.evaluate(_OK, ".py")                   # forks the spares
        r = ev.evaluate(probe, ".py")
    finally:
        ev.close()
    assert r.verdict is Verdict.PASS, r.reason
    assert "reference" not in r.stage_s           # it ran in a spare


def test_a_candidate_out_of_memory_beside_the_spares_is_evaluated_again_without_them(
        tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Spares hold device memory of their own: a candidate that runs out of it beside them is
    evaluated again alone, and if it fits then, the slot keeps no spares from then on. Here the
    candidate "runs out" while another spare waits (its go FIFO exists)."""
    import glob
    work = tmp_path / "work"                              # this evaluator's directories only
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    pattern = os.path.join(str(work), "evoattn-*", ".evoattn", "go.fifo")
    crowded = _sdpa_candidate(
        at_import="import glob\n",
        in_call=f"    if glob.glob({pattern!r}):\n"
                "        raise torch.OutOfMemoryError('CUDA out of memory (spares beside it)')\n")
    ev = _spared(tmp_path)
    try:
        ev.evaluate(_OK, ".py")                           # forks the spares
        assert glob.glob(pattern)
        r = ev.evaluate(crowded, ".py")
        assert r.verdict is Verdict.PASS, r.reason
        assert any("without spare processes" in f for f in r.flags)
        assert not ev._spares and not ev._spare_queue and not glob.glob(pattern)
        hog = "import torch\n\ndef attention(q, k, v, causal=False, scale=None):\n" \
              "    raise torch.OutOfMemoryError('CUDA out of memory')\n"
        assert ev.evaluate(hog, ".py").verdict is Verdict.OOM    # alone too: the verdict
    finally:
        ev.close()
    ev = _spared(tmp_path)
    try:
        ev.evaluate(_OK, ".py")
        r = ev.evaluate(hog, ".py")                     # out of memory alone as well
        assert r.verdict is Verdict.OOM and not r.flags
        assert ev._spares                                 # the spares were not the cause:
        ev.evaluate(_OK, ".py")
        assert ev._spare_queue                            # kept from the next candidate on
    finally:
        ev.close()
