"""The search loop with LLM-like mutators: paid calls kept at a stop, a clean stop when the LLM
cannot go on, and the siblings a prompt may wait for."""
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

from evoattn.config import PopulationConfig, RunConfig, config_to_dict
from evoattn.errors import LlmUnavailable
from evoattn.mutators.knobs import KnobMutator
from evoattn.search import Search
from evoattn.store import RunStore
from evoattn.types import LlmUsage, MutationRequest, Proposal
from fakes import TOY_SEED, FakeEvaluator
from rundb import query


class _Paid:
    """Answers after a short wait with a knob child and a paid usage, like an LLM call; from
    call `fail_at` on it raises LlmUnavailable (the first time with the failed call's usage)."""

    name = "llm:paid"
    blocking_io = True

    def __init__(self, fail_at: int | None = None) -> None:
        self.knobs = KnobMutator(0.0)
        self.fail_at = fail_at
        self.calls = 0
        self.requests: list[MutationRequest] = []
        self.lock = threading.Lock()

    def propose(self, request: MutationRequest) -> Proposal:
        with self.lock:
            self.calls += 1
            n = self.calls
            self.requests.append(request)
        time.sleep(0.05)
        if self.fail_at is not None and n >= self.fail_at:
            usage = LlmUsage("m", attempts=2, status="failed") if n == self.fail_at else None
            raise LlmUnavailable("the LLM stopped the run: model m at http://x/v1: down",
                                 usage=usage)
        p = self.knobs.propose(request)
        return dataclasses.replace(p, mutator=self.name,
                                   usage=LlmUsage("m", 100, 10, 0.01, 0.05, 1))


def _cfg(**kw: object) -> RunConfig:
    base = RunConfig(iterations=20, random_seed=3,
                     population=PopulationConfig(islands=1, elites_per_island=2))
    return dataclasses.replace(base, **kw)


def _run(run_dir: Path, cfg: RunConfig, mutator: object, create: bool = True, **kw: object):
    store = RunStore.open(run_dir, config_to_dict(cfg), create=create)
    try:
        return Search(cfg, store, FakeEvaluator(), [(mutator, 1.0)], TOY_SEED, ".py",
                      **kw).run()
    finally:
        store.close()



def test_a_budget_stop_records_every_call_already_paid(tmp_path: Path) -> None:
    paid = _Paid()
    out = _run(tmp_path, _cfg(), paid, lookahead=3,
               budget_exhausted=lambda: paid.calls >= 2)
    assert out.stop_reason == "LLM budget exhausted" and out.exit_code == 0
    assert paid.calls >= 3                     # more calls were in flight than the budget let
    (calls,) = query(tmp_path, "SELECT count(*) FROM llm_calls")[0]
    assert calls == paid.calls                  # ... and each one is in the call log
    assert out.iterations_done == paid.calls


def test_an_llm_that_cannot_go_on_stops_the_run_cleanly_and_it_resumes(tmp_path: Path) -> None:
    failing = _Paid(fail_at=4)
    out = _run(tmp_path, _cfg(), failing, lookahead=2)
    assert out.exit_code == 1 and out.stop_reason.startswith("the LLM stopped the run")
    assert "http://x/v1" in out.stop_reason
    rows = query(tmp_path, "SELECT iteration, reason FROM rejections")
    assert (4, out.stop_reason) in rows         # the failing call's iteration is committed ...
    statuses = query(tmp_path, "SELECT status FROM llm_calls ORDER BY iteration")
    assert [s for (s,) in statuses] == ["ok"] * 3 + ["failed"]   # ... with its call
    assert out.iterations_done == 4
    with RunStore.open_readonly(tmp_path) as st:
        assert st.load_state()["stop_reason"] == out.stop_reason
    again = _run(tmp_path, _cfg(iterations=8), _Paid(), create=False, lookahead=2)
    assert again.exit_code == 0 and again.iterations_done == 8


def test_a_request_lists_the_siblings_in_flight_with_its_parent(tmp_path: Path) -> None:
    class Rejecting(_Paid):
        def propose(self, request: MutationRequest) -> Proposal:
            with self.lock:
                self.requests.append(request)
            return Proposal(request.parent.id, self.name, None, rejected_reason="no edit")

    mut = Rejecting()
    _run(tmp_path, _cfg(iterations=6), mut, lookahead=2)
    pending = {r.iteration: r.pending for r in mut.requests}
    # one island, no child: every request has the seed as parent; the window holds 3
    assert pending[1] == () and pending[2] == (1,) and pending[3] == (1, 2)
    assert pending[4] == (2, 3) and pending[6] == (4, 5)
