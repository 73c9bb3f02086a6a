"""Prints the size of the LLM mutator's prompt, per call, for every shipped seed.

    python -m benchmarks.experiments.prompt_sizes

It measures the checkout it is run from (its seeds, its configs, its mutator): for a
before/after, run it from the root of each (`git worktree add DIR COMMIT`, this file copied in).

Each seed is the parent of one call, through the real LlmMutator (a recording client stands
in for the server): evaluated and passing at the problem's configs (CPU configs on the CPU
target, GPU configs on sm90), with 3 inspirations that each differ from it by one knob (what
a run's elites look like) and 4 earlier attempts on it (a rejected edit, a failed child, a
passing child, a duplicate). Models: configs/llm.yaml's first model as a 1M-token context
and as a 32k one (answer room: llm.yaml's max_tokens, at most half the context).

Tokens are estimated as ceil(characters / 3.0), the rule evoattn/mutators/budget.py fits
prompts with (an upper bound: OpenAI's tokenizers give about 3.5-4 characters a token here).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path

from benchmarks.common import ROOT

def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    repo = ROOT
    rows = []
    for problem, path, source in seeds(repo):
        targets = ("sm90",) if path.endswith(".cu") else ("cpu", "sm90")
        for target in targets:
            for context in (1_048_576, 32_768):
                chars, answer, note = measure(repo, problem, path, source, target, context)
                rows.append((path, target, context, chars, answer, note))
    print("| seed | target | context | prompt chars | est. tokens | answer room | left out |")
    print("|---|---|---|---|---|---|---|")
    for path, target, context, chars, answer, note in rows:
        ctx = "1M" if context > 100_000 else f"{context // 1024}k"
        print(f"| {path} | {target} | {ctx} | {chars:,} | {-(-chars // 3):,} | {answer} | {note} |")


def seeds(repo: Path) -> list[tuple[str, str, str]]:
    """Returns (problem, path, program text, companions included) for every shipped seed."""
    from evoattn.contract import program
    out = []
    for p in sorted((repo / "seeds").glob("*/*")):
        if p.suffix in (".py", ".cu"):
            try:
                text = program.read(p) if hasattr(program, "read") else p.read_text()
            except Exception:  # noqa: BLE001 - a seed's companion missing in that checkout
                text = p.read_text()
            out.append((p.parent.name, str(p.relative_to(repo)), text))
    return out


def measure(repo: Path, problem_name: str, path: str, source: str, target: str,
            context: int) -> tuple[int, int, str]:
    """Returns (prompt characters, answer tokens asked for, what was left out) of one call."""
    from evoattn.problems import get_problem
    from evoattn.contract.types import ConfigResult, EvalResult, Verdict
    from evoattn.config import load_config
    from evoattn.mutators import llm
    from evoattn.mutators.knobs import find_knobs, set_knobs
    from evoattn.types import MutationRequest, Program, program_id

    problem = get_problem(problem_name)
    cfgs = problem.cpu_configs if target == "cpu" else problem.default_configs
    on_cpu = target == "cpu"
    device = "cpu (x86_64)" if on_cpu else "NVIDIA H100 80GB HBM3"
    info = ({"peak_fp16": None, "peak_fp32": None} if on_cpu else
            {"sm_count": 132, "capability": "9.0", "smem_per_block_optin": 232448,
             "peak_fp16": 989.4, "peak_fp32": 66.9})

    def result(fitness: float) -> EvalResult:
        rows = tuple(ConfigResult(dict(c), "float16", Verdict.PASS, max_abs_err=1e-3,
                                  tolerance=4e-3, ms=0.2 / fitness, baseline_ms=0.2,
                                  speedup=fitness) for c in cfgs)
        kw = dict(device=device, timing_device="cpu" if on_cpu else "cuda",
                  versions={"torch": "2.13.0", "triton": "3.6.0", "python": "3.12.3",
                            "cuda": "None" if on_cpu else "12.8"}, device_info=info)
        fields = {f.name for f in dataclasses.fields(EvalResult)}
        return EvalResult(Verdict.PASS, "", fitness, rows,
                          **{k: v for k, v in kw.items() if k in fields})

    suffix = ".cu" if path.endswith(".cu") else ".py"
    parent = Program(program_id(source), source, suffix, None, 0, 0, "seed", "", result(0.95))
    others = []
    for i, k in enumerate(find_knobs(source)[:3]):
        other = next((c for c in k.choices if c != k.value), k.value)
        text = set_knobs(source, {getattr(k, "key", "") or k.name: other})
        others.append(Program(program_id(text), text, suffix, parent.id, i + 1, 0, "knobs",
                              f"{k.name}: {k.value} -> {other}", result(0.96 + i / 100)))
    cfg = load_config(repo / "configs/llm.yaml").llm
    model = dataclasses.replace(cfg.models[0], base_url="http://127.0.0.1:9/v1")
    if "context_tokens" in {f.name for f in dataclasses.fields(model)}:
        model = dataclasses.replace(model, context_tokens=context)
    cfg = dataclasses.replace(cfg, models=(model,))
    client = _Recorder()
    kw, fields = {}, {f.name for f in dataclasses.fields(MutationRequest)}
    reasons = _events(source)
    if "feedback" in fields:              # before: reasons the search kept in memory
        kw["feedback"] = tuple(r for r, _ in reasons)
    mut_kw = {}
    if "history" in inspect.signature(llm.LlmMutator.__init__).parameters:
        mut_kw = {"history": _History(reasons), "facts": {"target": target},
                  "knobs_tuned": True}
    mut = llm.LlmMutator(cfg, llm.CostMeter(), client, **mut_kw)
    req = MutationRequest(parent, tuple(others), 7, 9, problem_contract=problem.contract,
                          gpu_info={"name": device, **info}, **kw)
    mut.propose(req)
    if not client.calls:
        return 0, 0, "(no call: the prompt does not fit)"
    messages, max_tokens = client.calls[0]
    return sum(len(m["content"]) for m in messages), max_tokens, _left_out(messages)


def _events(source: str) -> list[tuple[str, object]]:
    """Returns four earlier outcomes for the parent: (old-style reason, Attempt) pairs."""
    from evoattn.mutators.edits import summarise_change
    from evoattn.mutators.knobs import find_knobs, set_knobs
    knobs = find_knobs(source)
    changed = set_knobs(source, {getattr(knobs[-1], "key", "") or knobs[-1].name:
                                 knobs[-1].choices[0]}) if knobs else source + "\n# v2\n"
    diff = summarise_change(source, changed)
    try:
        from evoattn.types import Attempt
    except ImportError:
        Attempt = None                    # noqa: N806 - the checkout predates it
    events = [
        ("edit block: the SEARCH text starting 'acc = tl.zeros' was not found in the source",
         ("rejected", "edit block: the SEARCH text starting 'acc = tl.zeros' was not found")),
        (f"a child ({diff[:200]}) failed: incorrect: 1 of 2 configs incorrect",
         ("incorrect", "1 of 2 configs incorrect")),
        ("", ("pass", "")),
        ("", ("duplicate", "program 0123456789abcdef: pass, fitness 0.95")),
    ]
    return [(r, Attempt(i + 1, "llm:m", o, why, diff, 0.9) if Attempt else None)
            for i, (r, (o, why)) in enumerate(events) if r or Attempt]


class _History:
    def __init__(self, events: list[tuple[str, object]]) -> None:
        self.items = [a for _, a in events if a is not None]

    def committed_iteration(self) -> int:
        return 10 ** 6

    def attempts(self, parent_id: str, limit: int) -> list:
        return self.items[-limit:]


class _Recorder:
    """A ChatClient that records each request and answers with no edit."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, int]] = []

    def complete(self, model, messages, *, temperature, max_tokens, timeout_s):
        from evoattn.mutators.llm import ChatReply
        self.calls.append((list(messages), max_tokens))
        return ChatReply("no edit")

    def context_tokens(self, model) -> None:
        return None


def _left_out(messages: list) -> str:
    text = messages[-1]["content"]
    notes = []
    if "Not shown:" in text:
        notes.append("files not shown: " + ", ".join(
            line.split(":")[1].split("(")[0].strip() for line in text.splitlines()
            if line.startswith("- Not shown:")))
    if "are left out to fit" in text:
        notes.append("lines of the largest file")
    if "## Other programs" not in text:
        notes.append("no other programs")
    return "; ".join(notes) or "-"


if __name__ == "__main__":
    main()
