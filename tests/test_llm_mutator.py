"""LLM mutator: prompts, retries, budget, failure policy and key hygiene, against a real local server."""
from __future__ import annotations

import logging
import threading

import pytest

from evoattn.contract.types import ConfigResult, EvalResult, Verdict
from evoattn.config import LlmConfig, ModelConfig
from evoattn.errors import LlmError, UsageError
from evoattn.mutators.llm import (
    BUDGET_EXHAUSTED, CallRecord, ChatReply, CostMeter, LlmMutator,
    cost_usd, parse_retry_after,
)
from evoattn.mutators.prompts import build_messages
from evoattn.types import Attempt, MutationRequest, Program
from llm_server import LlmServer, error, reply, stall

KEY = "sk-test-S3CRETKEY-0123456789abcdef"
ENV = "EVOATTN_TEST_LLM_KEY"
GPU = {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "peak_tflops_fp16": 989.0}
CONTRACT = "CONTRACT: attention(q, k, v, causal) returns softmax(q k^T * D^-0.5) v, (B, H, S, D)."

SOURCE = """\
import triton


def _reference(q, k, v):
    scale = q.shape[-1] ** -0.5
    return naive(q, k, v, scale)


def attention(q, k, v, causal):
    BLOCK_M = 64
    BLOCK_N = 64
    scale = q.shape[-1] ** -0.5
    return kernel(q, k, v, scale, BLOCK_M, BLOCK_N)
"""

GOOD_EDIT = "Bigger tiles.\n<<<<<<< SEARCH\n    BLOCK_M = 64\n=======\n    BLOCK_M = 128\n>>>>>>> REPLACE\n"
BAD_EDIT = "<<<<<<< SEARCH\n    BLOCK_K = 32\n=======\n    BLOCK_K = 64\n>>>>>>> REPLACE\n"
AMBIGUOUS_EDIT = "<<<<<<< SEARCH\n    scale = q.shape[-1] ** -0.5\n=======\n    scale = 0.125\n>>>>>>> REPLACE\n"


def make_parent() -> Program:
    ok = ConfigResult({"B": 2, "H": 8, "S": 1024, "D": 64, "causal": False}, "float16", Verdict.PASS,
                      max_abs_err=1e-3, tolerance=4e-3, ms=0.21, baseline_ms=0.25, speedup=1.19)
    bad = ConfigResult({"B": 1, "H": 4, "S": 1023, "D": 128, "causal": True}, "float16",
                       Verdict.INCORRECT, reason="mismatch in the last row block",
                       max_abs_err=0.25, tolerance=5e-3)
    result = EvalResult.failure(Verdict.INCORRECT, "1 of 2 configs incorrect", configs=(ok, bad),
                                log_tail="UNIQUE-LOG-LINE: row 1022 differs")
    return Program(id="parent01", source=SOURCE, suffix=".py", parent_id="seed", iteration=2,
                   island=0, mutator="knobs", change="", result=result)


INSPIRATION = Program(id="insp01", source="# INSPIRATION-SOURCE: persistent kernel\n", suffix=".py",
                      parent_id="seed", iteration=1, island=1, mutator="llm:x", change="",
                      result=EvalResult(verdict=Verdict.PASS, reason="", fitness=1.42))


def request(seed: int = 7, parent: Program | None = None) -> MutationRequest:
    return MutationRequest(parent=parent or make_parent(), inspirations=(INSPIRATION,), seed=seed,
                           iteration=3, problem_contract=CONTRACT, gpu_info=GPU)


class ListHistory:
    """A History over a list: what a store would hold for parent01."""

    def __init__(self, attempts: list[Attempt] | None = None) -> None:
        self.items = list(attempts or [])

    def committed_iteration(self) -> int:
        return 10 ** 6

    def attempts(self, parent_id: str, limit: int) -> list[Attempt]:
        return self.items[-limit:] if parent_id == "parent01" else []


@pytest.fixture
def server():
    with LlmServer() as srv:
        yield srv


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(ENV, KEY)


def model(srv: LlmServer, name: str = "model-a", **kw) -> ModelConfig:
    kw.setdefault("price_in_per_mtok", 2.0)
    kw.setdefault("price_out_per_mtok", 8.0)
    return ModelConfig(name=name, base_url=srv.base_url, api_key_env=ENV, **kw)


def mutator(srv: LlmServer, *, models=None, budget=None, history=None, **cfg_kw):
    """Returns (mutator, meter, sleeps) wired to the server through the real OpenAI client."""
    cfg_kw.setdefault("timeout_s", 1.0)
    cfg_kw.setdefault("max_retries", 2)
    cfg_kw.setdefault("backoff_s", 0.5)
    cfg_kw.setdefault("max_consecutive_failures", 100)
    cfg = LlmConfig(models=tuple(models or (model(srv),)), budget_usd=budget, **cfg_kw)
    sleeps: list[float] = []
    meter = CostMeter(cfg.budget_usd)
    return LlmMutator(cfg, meter, sleep=sleeps.append, history=history), meter, sleeps


# ---- answers ------------------------------------------------------------

def test_valid_edit_becomes_a_child_with_diff_usage_and_cost(server):
    server.push(reply(GOOD_EDIT, prompt_tokens=1000, completion_tokens=500))
    mut, meter, _ = mutator(server)
    p = mut.propose(request())
    assert p.rejected_reason is None and not p.rejected
    assert p.source == SOURCE.replace("BLOCK_M = 64", "BLOCK_M = 128")
    assert "-    BLOCK_M = 64" in p.change and "+    BLOCK_M = 128" in p.change
    assert p.parent_id == "parent01" and p.mutator == "llm:model-a"
    # 1000 * $2/M + 500 * $8/M = 0.002 + 0.004
    assert p.usage.cost_usd == pytest.approx(0.006)
    assert (p.usage.model, p.usage.prompt_tokens, p.usage.completion_tokens, p.usage.attempts) == \
        ("model-a", 1000, 500, 1)
    assert p.usage.latency_s > 0
    assert meter.spent_usd == pytest.approx(0.006) and meter.calls == 1
    assert (meter.prompt_tokens, meter.completion_tokens) == (1000, 500)
    (rec,) = meter.drain()
    assert rec.status == "ok" and rec.parent_id == "parent01" and rec.iteration == 3
    assert meter.drain() == ()


def test_prompt_carries_contract_gpu_parent_results_and_inspirations(server):
    server.push(reply(GOOD_EDIT))
    mut, _, _ = mutator(server)
    mut.propose(request())
    (req,) = server.requests
    system, user = req.body["messages"]
    assert system["role"] == "system" and user["role"] == "user"
    assert "online softmax" in system["content"].lower() and "<<<<<<< SEARCH" in system["content"]
    text = user["content"]
    assert SOURCE.rstrip("\n") in text
    assert CONTRACT in text
    assert "GPU: NVIDIA H100 80GB HBM3" in text and "sm_count 132" in text
    assert "Triton's interpreter" not in text
    assert "B=1,H=4,S=1023,D=128,causal=True" in text            # the failing config ...
    assert "max_abs_err 0.25 vs tolerance 0.005 (50x over)" in text   # ... and by how much
    assert "UNIQUE-LOG-LINE" in text
    assert "+# INSPIRATION-SOURCE: persistent kernel" in text and "fitness 1.42" in text
    assert "-    BLOCK_M = 64" in text                      # a diff against the parent
    assert "Fix it so that every config passes" in text


def test_whole_program_answer_replaces_the_source(server):
    program = "import triton\n\n\ndef attention(q, k, v, causal):\n    return fused(q, k, v, causal)\n"
    server.push(reply(f"Rewritten:\n```python\n{program}```\nDone."))
    mut, _, _ = mutator(server)
    p = mut.propose(request())
    assert p.source == program and "+    return fused(q, k, v, causal)" in p.change


def test_malformed_edit_is_rejected_and_recorded_attempts_reach_the_next_prompt(server):
    server.push(reply(BAD_EDIT), reply(GOOD_EDIT))
    history = ListHistory()
    mut, meter, _ = mutator(server, history=history)
    first = mut.propose(request())
    assert first.rejected and first.source is None
    assert "'BLOCK_K = 32' was not found" in first.rejected_reason
    assert "'BLOCK_M = 64'" in first.rejected_reason or "'BLOCK_N = 64'" in first.rejected_reason
    assert first.usage is not None and meter.calls == 1          # a bad answer still cost money
    assert "-    BLOCK_K = 32" in first.change and "+    BLOCK_K = 64" in first.change

    history.items.append(Attempt(3, first.mutator, "rejected", first.rejected_reason,
                                 first.change))
    history.items.append(Attempt(4, "llm:model-a", "incorrect", "1 of 2 configs incorrect",
                             "--- parent\n+++ child\n@@ -1 +1 @@\n-    BLOCK_N = 64\n"
                             "+    BLOCK_N = 96\n context"))
    second = mut.propose(request(seed=8))
    assert not second.rejected
    prompt = server.requests[1].prompt
    assert "Already tried on this program" in prompt
    assert first.rejected_reason in prompt and "iteration 3, llm:model-a" in prompt
    assert "incorrect: 1 of 2 configs incorrect" in prompt
    assert "-    BLOCK_N = 64\n  +    BLOCK_N = 96" in prompt    # the changed lines themselves
    assert first.rejected_reason not in server.requests[0].prompt


def test_ambiguous_edit_is_rejected(server):
    server.push(reply(AMBIGUOUS_EDIT))
    mut, _, _ = mutator(server)
    p = mut.propose(request())
    assert p.rejected and "ambiguous" in p.rejected_reason and "2 places" in p.rejected_reason


def test_answer_cut_off_at_max_tokens_says_so(server):
    server.push(reply("<<<<<<< SEARCH\n    BLOCK_M = 64\n=====", finish_reason="length"))
    mut, _, _ = mutator(server)
    p = mut.propose(request())
    assert p.rejected and "cut off at max_tokens" in p.rejected_reason


# ---- retries ------------------------------------------------------------

def test_rate_limit_then_success_counts_two_attempts_and_honours_retry_after(server):
    server.push(error(429, "slow down", retry_after="7"), reply(GOOD_EDIT))
    mut, meter, sleeps = mutator(server)
    p = mut.propose(request())
    assert not p.rejected and p.usage.attempts == 2
    assert sleeps == [7.0]
    assert len(server.requests) == 2 and meter.calls == 1 and meter.attempts == 2


def test_server_errors_back_off_exponentially_with_seeded_jitter(server):
    server.push(error(500), error(503), reply(GOOD_EDIT), error(502), error(500), reply(GOOD_EDIT))
    mut, _, sleeps = mutator(server, backoff_s=0.5)
    assert mut.propose(request(seed=11)).usage.attempts == 3
    assert mut.propose(request(seed=11)).usage.attempts == 3
    assert 0.5 <= sleeps[0] <= 0.75 and 1.0 <= sleeps[1] <= 1.5
    assert sleeps[:2] == sleeps[2:]                                # same seed, same jitter


def test_stalled_response_times_out_and_the_retry_succeeds(server):
    server.push(stall(1.6), reply(GOOD_EDIT))
    mut, _, sleeps = mutator(server, timeout_s=1.0)
    p = mut.propose(request())
    assert not p.rejected and p.usage.attempts == 2 and len(sleeps) == 1
    assert len(server.requests) == 2


def test_exhausted_retries_give_a_rejected_proposal_not_an_exception(server):
    server.push(error(500), error(500), error(500), reply(GOOD_EDIT))
    mut, meter, sleeps = mutator(server, max_retries=2)
    p = mut.propose(request())
    assert p.rejected and p.rejected_reason.startswith(
        f"LLM call failed after 3 attempt(s): model model-a at {server.base_url}: HTTP 500")
    assert len(server.requests) == 3 and len(sleeps) == 2 and server.pending == 1
    assert p.usage.attempts == 3 and p.usage.cost_usd == 0.0 and p.usage.status == "failed"
    (rec,) = meter.drain()
    assert rec.status == "failed" and "HTTP 500" in rec.error


def test_other_client_errors_are_not_retried(server):
    server.push(error(400, "maximum context length exceeded"),
                error(400, "maximum context length exceeded"))
    mut, _, sleeps = mutator(server)
    p = mut.propose(request())
    assert p.rejected and "HTTP 400: the prompt does not fit the model's context: maximum " \
        "context length exceeded" in p.rejected_reason
    assert len(server.requests) == 2          # a context error is sent once more, smaller
    server.push(error(400, "bad request: unknown field"), reply(GOOD_EDIT))
    p = mut.propose(request())
    assert p.rejected and "HTTP 400: bad request: unknown field" in p.rejected_reason
    assert len(server.requests) == 3 and sleeps == []


def test_authentication_error_raises_without_retrying(server):
    server.push(error(401, "invalid key"), reply(GOOD_EDIT))
    mut, meter, sleeps = mutator(server)
    with pytest.raises(LlmError, match=ENV):
        mut.propose(request())
    assert len(server.requests) == 1 and sleeps == []
    (rec,) = meter.drain()
    assert rec.status == "fatal"


# ---- budget -------------------------------------------------------------

def test_budget_exhaustion_stops_further_calls(server):
    server.push(reply(GOOD_EDIT, prompt_tokens=1000, completion_tokens=500), reply(GOOD_EDIT))
    mut, meter, _ = mutator(server, budget=0.005)                    # one call costs 0.006
    assert not mut.propose(request()).rejected
    assert meter.exhausted and meter.remaining == 0.0
    p = mut.propose(request(seed=8))
    assert p.rejected_reason == BUDGET_EXHAUSTED and p.usage is None
    assert len(server.requests) == 1 and server.pending == 1


def test_cost_meter_totals_are_exact_under_threads():
    meter = CostMeter(budget_usd=1.0)
    rec = CallRecord("m", "ok", prompt_tokens=3, completion_tokens=2, cost_usd=0.001, attempts=2)

    def work():
        for _ in range(500):
            meter.record(rec)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert meter.calls == 4000 and meter.attempts == 8000
    assert (meter.prompt_tokens, meter.completion_tokens) == (12000, 8000)
    assert meter.spent_usd == pytest.approx(4.0) and meter.exhausted and meter.remaining == 0.0
    assert len(meter.drain()) == min(4000, CostMeter.KEEP_RECORDS)   # bounded, newest kept


def test_cost_uses_per_million_token_prices():
    m = ModelConfig(name="m", price_in_per_mtok=3.0, price_out_per_mtok=15.0)
    assert cost_usd(m, 2_000_000, 100_000) == pytest.approx(6.0 + 1.5)
    assert CostMeter().remaining is None and not CostMeter().exhausted
    assert CostMeter(budget_usd=0.0).exhausted


# ---- request parameters -------------------------------------------------

def test_reasoning_model_sends_max_completion_tokens_and_no_temperature(server):
    server.push(reply(GOOD_EDIT))
    mut, _, _ = mutator(server, models=[model(server, "o-think", reasoning=True)], max_tokens=4096)
    mut.propose(request())
    body = server.requests[0].body
    assert body["model"] == "o-think" and body["max_completion_tokens"] == 4096
    assert "temperature" not in body and "max_tokens" not in body


def test_chat_model_sends_max_tokens_and_temperature(server):
    server.push(reply(GOOD_EDIT))
    mut, _, _ = mutator(server, temperature=0.3, max_tokens=2048)
    mut.propose(request())
    body = server.requests[0].body
    assert body["max_tokens"] == 2048 and body["temperature"] == 0.3
    assert "max_completion_tokens" not in body


def test_model_is_drawn_by_weight_with_the_request_seed(server):
    models = [model(server, "a", weight=1.0), model(server, "b", weight=3.0), model(server, "off", weight=0.0)]
    server.push(*[reply(GOOD_EDIT)] * 40)
    mut, _, _ = mutator(server, models=models)
    names = [mut.propose(request(seed=s)).mutator for s in range(40)]
    assert set(names) == {"llm:a", "llm:b"} and names.count("llm:b") > names.count("llm:a")
    assert [r.body["model"] for r in server.requests] == [n.removeprefix("llm:") for n in names]
    assert names[5] == mut.propose(request(seed=5)).mutator          # script empty: 418, still llm:<same>


def test_bad_model_weights_are_usage_errors(server):
    with pytest.raises(UsageError, match="weights"):
        LlmMutator(LlmConfig(models=(model(server, weight=0.0),)), CostMeter(), client=_NeverClient())


class _NeverClient:
    def complete(self, *a, **kw) -> ChatReply:
        raise AssertionError("no call expected")


# ---- the API key --------------------------------------------------------

def test_missing_key_is_a_usage_error_naming_the_variable(monkeypatch):
    monkeypatch.delenv(ENV)
    remote = ModelConfig(name="m", base_url="https://llm.example.invalid/v1", api_key_env=ENV)
    with pytest.raises(UsageError, match=ENV):
        LlmMutator(LlmConfig(models=(remote,)), CostMeter())


def test_local_endpoint_needs_no_key(server, monkeypatch):
    monkeypatch.delenv(ENV)
    server.push(reply(GOOD_EDIT))
    mut, _, _ = mutator(server)
    assert not mut.propose(request()).rejected
    assert server.requests[0].headers["authorization"].startswith("Bearer ")


def test_key_is_sent_but_never_appears_in_results_errors_or_logs(server, caplog):
    caplog.set_level(logging.DEBUG)
    masked = KEY[:6] + "***" + KEY[-4:]
    server.push(
        error(429, f"rate limited for key {KEY}", retry_after="1"), reply(BAD_EDIT),  # retried, rejected
        error(500), error(500), error(500, f"upstream saw {KEY} ({masked})"),           # exhausted
        error(401, f"Incorrect API key provided: {masked}"),                            # fatal
    )
    mut, meter, _ = mutator(server)
    proposals = [mut.propose(request()), mut.propose(request())]
    with pytest.raises(LlmError) as info:
        mut.propose(request())
    assert server.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert "HTTP 500: upstream saw ***" in proposals[1].rejected_reason     # scrubbed, not dropped
    assert "HTTP 429: rate limited for key ***" in caplog.text
    texts = [repr(p) for p in proposals] + [repr(r) for r in meter.drain()]
    texts += [str(info.value), repr(info.value), repr(mut.client), repr(meter), caplog.text]
    for text in texts:
        assert KEY not in text and KEY[:10] not in text and KEY[-8:] not in text and masked not in text


# ---- small parsers ------------------------------------------------------

def test_retry_after_accepts_seconds_milliseconds_and_dates():
    assert parse_retry_after({"retry-after": "2.5"}) == 2.5
    assert parse_retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert parse_retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0   # in the past
    assert parse_retry_after({"retry-after": "soon"}) is None and parse_retry_after({}) is None
    assert parse_retry_after({"retry-after": "100000"}) == 300.0


def test_prompt_for_a_passing_parent_asks_for_speed_and_lists_recent_attempts_last():
    parent = Program(id="p", source="__global__ void k() {}\n", suffix=".cu", parent_id=None,
                     iteration=0, island=0, mutator="seed", change="",
                     result=EvalResult(verdict=Verdict.PASS, reason="", fitness=1.1))
    attempts = [Attempt(i, "llm:m", "rejected", f"reason-{i}") for i in range(10)]
    req = MutationRequest(parent, inspirations=(parent,), seed=0, iteration=1)
    system, user = build_messages(req, output_format="full", attempts=attempts)
    assert "whole program" in system["content"].lower() and "```cuda" in system["content"]
    text = user["content"]
    assert "```cuda\n__global__ void k() {}\n```" in text
    assert "makes the current program faster on this GPU" in text
    assert "reason-9" in text and "reason-2" in text and "reason-1" not in text   # 8 most recent
    assert text.index("reason-8") < text.index("reason-9")
    assert "Other programs" not in text                                         # parent is not its own inspiration
    assert "GPU: (not given)" in text


# ---- the model's context ------------------------------------------------

def test_the_context_the_server_reports_sizes_the_call_and_one_too_small_gets_no_call():
    with LlmServer(models={"model-a": {"max_model_len": 6000}}) as srv:
        srv.push(reply(GOOD_EDIT))
        mut, _, _ = mutator(srv, max_tokens=8192)
        assert not mut.propose(request()).rejected
        assert srv.requests[0].body["max_tokens"] == 3000        # half of the 6000 reported
    with LlmServer(models={"model-a": {"max_model_len": 2048}}) as srv:
        mut, meter, _ = mutator(srv, max_consecutive_failures=2)
        p = mut.propose(request())
        assert p.rejected and p.rejected_reason.startswith("the prompt does not fit the context "
                                                           f"of model model-a at {srv.base_url}")
        assert "(2048 tokens, 1024 kept for the answer)" in p.rejected_reason
        with pytest.raises(LlmError, match="2 calls in a row failed"):
            mut.propose(request())
        assert srv.requests == [] and meter.calls == 0            # nothing sent, nothing billed


def test_a_too_long_answer_naming_the_context_is_learnt_and_the_call_made_again(server):
    server.push(error(400, "This model's maximum context length is 5000 tokens. However, you "
                           "requested 9000 tokens (800 in the messages, 8192 in the completion)."),
                reply(GOOD_EDIT))
    mut, meter, _ = mutator(server, max_tokens=8192)
    p = mut.propose(request())
    assert not p.rejected and p.usage.attempts == 2
    assert [r.body["max_tokens"] for r in server.requests] == [8192, 2500]
