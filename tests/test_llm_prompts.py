"""LLM prompts: what they show of a program (files that run here), how they fit a model's
context, other programs as diffs, the target told truthfully, and answers applied only to
what was shown."""
from __future__ import annotations

from pathlib import Path


from evoattn.contract import program
from evoattn.problems import get_problem
from evoattn.contract.types import ConfigResult, EvalResult, Verdict
from evoattn.mutators.budget import split_context
from evoattn.mutators.knobs import set_knobs
from evoattn.mutators.prompts import PromptSettings, build_prompt
from evoattn.mutators.view import ProgramView
from evoattn.types import MutationRequest, Program, program_id

ROOT = Path(__file__).resolve().parent.parent
CPU = {"target": "cpu"}
# The default seed's user prompt on the CPU (no inspirations) stays under 46K chars, 42% of
# 110K, the size of a prompt that carries the whole multi-file seed, CUDA files included.
USER_PROMPT_BOUND_CHARS = 46_000

MAIN = """\
# evoattn: companion kern.cu when(@target=sm90)
# evoattn: companion helper.py
import helper
TILE = 64  # evoattn: choice(32, 64)


def attention(q, k, v, causal=False):
    return helper.run(q, k, v, TILE)
"""
HELPER = "def run(q, k, v, tile):\n    return q  # HELPER-BODY\n"
KERN = "__global__ void k() {  // CUDA-BODY\n}\n"
BUNDLE = program.join([("main.py", MAIN), ("helper.py", HELPER), ("kern.cu", KERN)])


def _result(fitness: float, timing_device: str = "cpu", configs: int = 2) -> EvalResult:
    rows = tuple(ConfigResult({"B": 1, "H": 2, "S": 64 * (i + 1), "D": 64}, "float16",
                              Verdict.PASS, ms=1.0, baseline_ms=fitness, speedup=fitness)
                 for i in range(configs))
    return EvalResult(Verdict.PASS, "", fitness, rows, device="cpu (x86_64)",
                      timing_device=timing_device,
                      versions={"torch": "2.13.0", "triton": "3.6.0", "cuda": "None"},
                      device_info={"peak_fp16": None})


def _program(source: str, fitness: float = 1.0, suffix: str = ".py") -> Program:
    return Program(program_id(source), source, suffix, None, 0, 0, "seed", "", _result(fitness))


def _request(parent: Program, others: tuple[Program, ...] = ()) -> MutationRequest:
    return MutationRequest(parent, others, 0, 1, problem_contract="CONTRACT")


# ---- what is shown, and what an answer may change ------------------------------------

def test_a_companion_that_cannot_run_here_is_listed_not_shown() -> None:
    prompt = build_prompt(_request(_program(BUNDLE)), PromptSettings(facts=CPU))
    user = prompt.messages[1]["content"]
    assert "HELPER-BODY" in user and "TILE = 64" in user
    assert "CUDA-BODY" not in user
    assert ("Not shown: kern.cu (2 lines): its condition when(@target=sm90) does not hold "
            "here (target cpu)") in user
    assert "#### evoattn file: main.py ####" in user and "#### evoattn file: helper.py ####" in user
    on_gpu = build_prompt(_request(_program(BUNDLE)), PromptSettings(facts={"target": "sm90"}))
    assert "CUDA-BODY" in on_gpu.messages[1]["content"]


def test_an_edit_of_a_shown_file_applies_to_the_whole_program() -> None:
    view = ProgramView.of(BUNDLE, ".py", CPU)
    out = view.apply("<<<<<<< SEARCH\n    return q  # HELPER-BODY\n=======\n"
                     "    return v  # HELPER-BODY\n>>>>>>> REPLACE\n")
    assert out.new_source is not None
    files = dict(program.split(out.new_source, "x").files)
    assert files["helper.py"] == HELPER.replace("return q", "return v")
    assert files["kern.cu"] == KERN and files["main.py"] == MAIN      # the hidden file kept


def test_an_answer_that_edits_a_hidden_file_is_rejected_saying_so() -> None:
    view = ProgramView.of(BUNDLE, ".py", CPU)
    out = view.apply("<<<<<<< SEARCH\n__global__ void k() {  // CUDA-BODY\n=======\n"
                     "__global__ void k2() {\n>>>>>>> REPLACE\n")
    assert out.new_source is None
    assert "quotes kern.cu, which is not shown" in out.reason and "@target=sm90" in out.reason
    whole = view.apply("```\n#### evoattn file: kern.cu ####\n__global__ void x() {}\n```\n")
    assert whole.new_source is None and "kern.cu, which is not shown" in whole.reason


def test_a_whole_file_answer_replaces_only_that_file_and_headers_must_stay() -> None:
    view = ProgramView.of(BUNDLE, ".py", CPU)
    new_helper = "def run(q, k, v, tile):\n    return k\n"
    out = view.apply(f"```python\n#### evoattn file: helper.py ####\n{new_helper}```\n")
    files = dict(program.split(out.new_source, "x").files)
    assert files["helper.py"] == new_helper and files["main.py"] == MAIN
    broken = view.apply("<<<<<<< SEARCH\n#### evoattn file: helper.py ####\n=======\n"
                        "#### evoattn file: other.py ####\n>>>>>>> REPLACE\n")
    assert broken.new_source is None and "header" in broken.reason


# ---- sized to the context -----------------------------------------------------------

def _big_parent() -> tuple[Program, tuple[Program, ...]]:
    body = "".join(f"    x{i} = q + {i}  # a line of the kernel body, number {i}\n"
                   for i in range(400))
    main = MAIN + "\n\ndef more(q):\n" + body + "    return q\n"
    source = program.join([("main.py", main), ("helper.py", HELPER * 40), ("kern.cu", KERN)])
    others = tuple(_program(source.replace("kernel body", f"body of variant {i}"), 1.1 + i)
                   for i in range(3))
    return _program(source), others


def _budget_for(prompt_tokens: int):
    return split_context(prompt_tokens + 2048 + 200, 2048)     # the prompt's share: exactly


def test_the_prompt_fits_the_context_dropping_others_before_cutting_the_parent() -> None:
    parent, others = _big_parent()
    settings = PromptSettings(facts=CPU)
    full = build_prompt(_request(parent, others), settings)
    bare = build_prompt(_request(parent), settings)
    assert full.messages[1]["content"].count("### Program") == 3
    for limit, shape in ((full.est_tokens + 30, "all"), (bare.est_tokens + 30, "fewer others"),
                         (bare.est_tokens * 2 // 3, "cut")):
        budget = _budget_for(limit)
        prompt = build_prompt(_request(parent, others), settings, (), budget)
        assert prompt is not None and prompt.est_tokens <= budget.prompt_tokens, shape
        user = prompt.messages[1]["content"]
        if shape == "all":
            assert user.count("### Program") == 3 and prompt.trimmed == ()
        elif shape == "fewer others":
            assert user.count("### Program") < 3 and prompt.view.elided is None
            assert prompt.view.shown == ("main.py", "helper.py")
        else:
            assert "## Other programs" not in user and prompt.view.elided is not None
            assert "are left out to fit the model's context" in user
            assert "edit blocks only" in prompt.messages[0]["content"]


def test_a_cut_parent_takes_edits_outside_the_cut_and_no_whole_program() -> None:
    parent, _ = _big_parent()
    bare = build_prompt(_request(parent), PromptSettings(facts=CPU))
    prompt = build_prompt(_request(parent), PromptSettings(facts=CPU), (),
                          _budget_for(bare.est_tokens // 2))
    view = prompt.view
    assert view.elided is not None
    edit = view.apply("<<<<<<< SEARCH\nTILE = 64  # evoattn: choice(32, 64)\n=======\n"
                      "TILE = 64  # evoattn: choice(32, 64, 128)\n>>>>>>> REPLACE\n")
    assert edit.new_source is not None and "choice(32, 64, 128)" in edit.new_source
    assert "x200 = q + 200" in edit.new_source                       # the cut lines kept
    whole = view.apply("```python\ndef attention(q, k, v, causal=False):\n    return q\n```\n")
    assert whole.new_source is None and "only SEARCH/REPLACE edits" in whole.reason


def test_no_prompt_when_not_even_the_instructions_fit() -> None:
    parent, _ = _big_parent()
    assert build_prompt(_request(parent), PromptSettings(facts=CPU), (),
                        split_context(1024, 512)) is None


def test_every_shipped_seed_fits_a_32k_context_and_the_default_seed_is_under_46k_chars() -> None:
    budget = split_context(32_768, 16_384)
    for path in sorted((ROOT / "seeds").glob("*/*")):
        if path.suffix not in (".py", ".cu"):
            continue
        source = program.read(path)
        parent = Program(program_id(source), source, path.suffix, None, 0, 0, "seed", "",
                         _result(1.0, "cpu" if path.suffix == ".py" else "cuda"))
        facts = CPU if path.suffix == ".py" else {"target": "sm90"}
        prompt = build_prompt(_request(parent), PromptSettings(facts=facts), (), budget)
        assert prompt is not None and prompt.est_tokens <= budget.prompt_tokens, path
    # The default sdpa seed, with its companions (Triton, the wgmma kernel, the CUDA-core
    # fallback), on the CPU: a 1M-token model gets it whole but for what cannot be edited there.
    hybrid = program.read(ROOT / "seeds/sdpa/flash_hybrid.py")
    alone = MutationRequest(_program(hybrid), (), 0, 1,
                            problem_contract=get_problem("sdpa").contract)
    user = build_prompt(alone, PromptSettings(facts=CPU), (),
                        split_context(1 << 20, 16_384)).messages[1]["content"]
    assert len(user) <= USER_PROMPT_BOUND_CHARS
    assert "wgmma_flash.cu" in user and "__global__" not in user


# ---- other programs, the target, the knobs --------------------------------------------

def test_other_programs_are_diffs_against_the_parent_with_their_results() -> None:
    parent = _program(BUNDLE, 1.0)
    other = _program(set_knobs(BUNDLE, {"TILE": "32"}), 1.25)
    same_shown = _program(BUNDLE.replace("CUDA-BODY", "CUDA-BODY-2"), 1.5)
    prompt = build_prompt(_request(parent, (other, same_shown)), PromptSettings(facts=CPU))
    user = prompt.messages[1]["content"]
    assert "-TILE = 64  # evoattn: choice(32, 64)\n+TILE = 32  # evoattn: choice(32, 64)" in user
    assert "| B=1,H=2,S=64,D=64 | 1.25 | 1 |" in user
    assert user.count("### Program") == 1       # one that differs only in a hidden file: left out
    assert "def attention" not in user.split("## Other programs")[1]   # no copy of the parent


def test_on_the_cpu_the_prompt_says_the_interpreter_runs_it_with_versions() -> None:
    prompt = build_prompt(_request(_program(BUNDLE)), PromptSettings(facts=CPU, knobs_tuned=True))
    system, user = (m["content"] for m in prompt.messages)
    assert "Triton's interpreter" in user and "not a GPU" in user
    assert "torch 2.13.0, triton 3.6.0" in user and "cuda None" not in user
    assert "NVIDIA" not in system + user and "this GPU" not in user
    assert "faster where it runs (the CPU, through Triton's interpreter)" in user
    assert "1 in the code shown, 1 of them take effect here" in user
    assert "A separate knob mutator already tunes their values" in user


def test_the_prompt_says_every_dtype_a_program_must_be_correct_in() -> None:
    import dataclasses

    from evoattn.mutators.sections import PromptLimits, results
    two = dataclasses.replace(_result(1.0), dtypes=("float16", "bfloat16"))
    text = results(two, PromptLimits())
    assert "Checked in float16, bfloat16: a program must be correct in each" in text
    assert "Checked in" not in results(dataclasses.replace(two, dtypes=("float16",)),
                                       PromptLimits())


# ptxas's advisories as nvcc prints them for a build that succeeds (no -v), and lines that are not
PTXAS_LOG = """\
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the function '_Z6kernelI6__halfEvv'
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the function '_Z6kernelI13__nv_bfloat16Evv'
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the wgmma pipeline in the function '_Z6kernelI6__halfEvv'
ptxas info    : Used 168 registers, used 1 barriers
"""


def test_ptxas_performance_notes_are_read_from_a_build_log_one_per_advisory() -> None:
    from evoattn.contract.runtime import perf_notes
    assert perf_notes(PTXAS_LOG) == [
        "C7515: wgmma.mma_async instructions are serialized due to non wgmma instructions "
        "defining accumulator registers of a wgmma between start and end of the pipeline "
        "stage (2 functions)",
        "C7511: wgmma.mma_async instructions are serialized due to insufficient register "
        "resources for the wgmma pipeline (1 function)"]
    assert perf_notes("ptxas info    : Used 168 registers, used 1 barriers\n") == []
    assert perf_notes("") == []


def test_a_correct_parent_whose_build_serialised_its_wgmma_is_told_so() -> None:
    import dataclasses

    from evoattn.mutators.sections import PromptLimits, results
    built = dataclasses.replace(_result(0.7), build_log=PTXAS_LOG)
    text = results(built, PromptLimits())
    assert "Compiler notes (ptxas" in text
    assert "- C7515: wgmma.mma_async instructions are serialized" in text and "(2 functions)" in text
    assert "Build log (excerpt)" not in text          # a correct build's log is not shown whole
    assert "Compiler notes" not in results(_result(0.7), PromptLimits())
    # a failed program gets its build log itself, not the notes
    failed = dataclasses.replace(built, verdict=Verdict.INCORRECT, fitness=0.0)
    failed_text = results(failed, PromptLimits())
    assert "Build log (excerpt)" in failed_text and "Compiler notes" not in failed_text


def test_evoattn_eval_prints_ptxas_performance_notes() -> None:
    import dataclasses

    from rich.console import Console

    from evoattn.report import print_eval
    console = Console(record=True, width=300)
    print_eval(console, dataclasses.replace(_result(0.7), build_log=PTXAS_LOG))
    text = console.export_text()
    assert "ptxas: C7515: wgmma.mma_async instructions are serialized" in text
    assert "ptxas: C7511:" in text
    plain = Console(record=True, width=300)
    print_eval(plain, _result(0.7))
    assert "ptxas" not in plain.export_text()


def test_a_prompt_shows_at_most_limits_notes_ptxas_notes() -> None:
    import dataclasses

    from evoattn.mutators.sections import PromptLimits, results
    log = "".join(f"ptxas info    : (C75{10 + i}) Potential Performance Loss: wgmma.mma_async "
                  f"instructions are serialized due to reason {i} in the function 'k'\n"
                  for i in range(7))
    text = results(dataclasses.replace(_result(0.7), build_log=log), PromptLimits(notes=3))
    shown = [line for line in text.splitlines() if line.startswith("- C75")]
    assert [line[2:7] for line in shown] == ["C7510", "C7511", "C7512"]
