"""Edits: parsing answers into SEARCH/REPLACE blocks or whole programs, applying them, diffs."""
from __future__ import annotations

from evoattn.mutators.edits import (
    NO_ANSWER, EditBlock, apply_answer, apply_edits, parse_answer, summarise_change,
)

SOURCE = """\
import triton


def attention(q, k, v, causal):
    BLOCK_M = 64
    BLOCK_N = 64
    scale = q.shape[-1] ** -0.5
    out = kernel(q, k, v, scale, BLOCK_M, BLOCK_N)
    return out
"""


def block(search: str, replace: str) -> str:
    return f"<<<<<<< SEARCH\n{search}\n=======\n{replace}\n>>>>>>> REPLACE"


# ---- parsing ------------------------------------------------------------

def test_parse_finds_several_blocks_inside_fences_and_prose():
    answer = ("Bigger tiles help.\n```python\n" + block("    BLOCK_M = 64", "    BLOCK_M = 128")
              + "\n```\nAnd a second one:\n```\n" + block("    BLOCK_N = 64", "    BLOCK_N = 32") + "\n```\n")
    parsed = parse_answer(answer, "python")
    assert parsed.reason is None and parsed.program is None
    assert parsed.blocks == (EditBlock("    BLOCK_M = 64", "    BLOCK_M = 128"),
                             EditBlock("    BLOCK_N = 64", "    BLOCK_N = 32"))


def test_parse_keeps_multiline_and_empty_replace_sections():
    parsed = parse_answer(block("a\nb", ""), "python")
    assert parsed.blocks == (EditBlock("a\nb", ""),)


def test_parse_reports_unclosed_edit_block_as_truncated():
    parsed = parse_answer("<<<<<<< SEARCH\nx = 1\n=======\nx = 2\n", "python")
    assert parsed.blocks == () and "not closed" in parsed.reason


def test_parse_reports_block_missing_its_divider():
    parsed = parse_answer("<<<<<<< SEARCH\nx = 1\n>>>>>>> REPLACE\n", "python")
    assert "malformed edit block 1" in parsed.reason


def test_parse_picks_longest_block_of_the_expected_language():
    small = "```python\nprint('snippet')\n```"
    big_py = "```python\nimport torch\n\ndef attention(q, k, v, causal):\n    return q\n```"
    huge_shell = "```bash\n" + "echo building\n" * 50 + "```"
    parsed = parse_answer(f"{small}\n{huge_shell}\n{big_py}\n", "python")
    assert parsed.program == "import torch\n\ndef attention(q, k, v, causal):\n    return q\n"


def test_parse_accepts_untagged_and_cpp_fences_for_cuda():
    assert parse_answer("```\n__global__ void k() {}\n```", "cuda").program == "__global__ void k() {}\n"
    assert parse_answer("```cpp\nint x;\n```", "cuda").program == "int x;\n"
    assert parse_answer("```python\nx = 1\n```", "cuda").reason == NO_ANSWER


def test_parse_reports_truncated_program():
    parsed = parse_answer("Here it is:\n```python\nimport torch\ndef attention(", "python")
    assert parsed.program is None and "not closed" in parsed.reason


def test_parse_rejects_prose_only_answer():
    assert parse_answer("I think you should use bigger tiles.", "python").reason == NO_ANSWER


# ---- applying -----------------------------------------------------------

def test_exact_edit_applies_and_counts_blocks():
    out = apply_edits(SOURCE, [EditBlock("    BLOCK_M = 64", "    BLOCK_M = 128"),
                               EditBlock("    BLOCK_N = 64", "    BLOCK_N = 32\n    WARPS = 4")])
    assert out.reason is None and out.applied == 2
    assert out.new_source == SOURCE.replace("BLOCK_M = 64", "BLOCK_M = 128").replace(
        "    BLOCK_N = 64", "    BLOCK_N = 32\n    WARPS = 4")


def test_later_block_sees_earlier_block_result():
    out = apply_edits(SOURCE, [EditBlock("    BLOCK_M = 64", "    BLOCK_M = 128"),
                               EditBlock("    BLOCK_M = 128", "    BLOCK_M = 256")])
    assert "BLOCK_M = 256" in out.new_source


def test_search_does_not_match_the_tail_of_a_longer_line():
    src = "max = 1\nx = 2\n"
    out = apply_edits(src, [EditBlock("x = 1", "x = 3")])
    assert out.new_source is None and "not found" in out.reason


def test_indent_and_trailing_whitespace_differences_match_when_unique():
    # The model dropped the function's indent and left trailing spaces.
    out = apply_edits(SOURCE, [EditBlock("\nBLOCK_M = 64   \nBLOCK_N = 64\n",
                                         "BLOCK_M = 128\nif causal:\n    BLOCK_N = 32")])
    assert out.reason is None
    assert "    BLOCK_M = 128\n    if causal:\n        BLOCK_N = 32\n    scale" in out.new_source


def test_over_indented_search_is_shifted_back():
    out = apply_edits(SOURCE, [EditBlock("        return out", "        return out.contiguous()")])
    assert out.new_source.endswith("    return out.contiguous()\n")


def test_loose_match_in_two_places_is_ambiguous():
    src = "def f():\n    x = 1\n\ndef g():\n  x = 1\n"
    out = apply_edits(src, [EditBlock("x = 1", "x = 2")])
    assert out.new_source is None
    assert "ambiguous" in out.reason and "2 places" in out.reason and "lines 2, 5" in out.reason


def test_exact_match_in_two_places_is_ambiguous_not_first_wins():
    src = "a = 1\nb = 2\na = 1\n"
    out = apply_edits(src, [EditBlock("a = 1", "a = 3")])
    assert out.new_source is None and "ambiguous" in out.reason and "'a = 1'" in out.reason


def test_missing_search_quotes_its_first_line_and_the_closest_source_line():
    out = apply_edits(SOURCE, [EditBlock("    scale = q.shape[-1] ** 0.5\n    out = x", "pass")])
    assert out.new_source is None and out.applied == 0
    assert "'scale = q.shape[-1] ** 0.5'" in out.reason
    assert "closest source line is 7: 'scale = q.shape[-1] ** -0.5'" in out.reason


def test_failure_in_second_block_rejects_all_and_names_the_block():
    out = apply_edits(SOURCE, [EditBlock("    BLOCK_M = 64", "    BLOCK_M = 128"),
                               EditBlock("    NUM_WARPS = 8", "    NUM_WARPS = 4")])
    assert out.new_source is None and out.applied == 1
    assert out.reason.startswith("edit block 2 of 2:")


def test_edit_that_changes_nothing_is_a_noop():
    out = apply_edits(SOURCE, [EditBlock("    BLOCK_M = 64", "    BLOCK_M = 64   ")])
    assert out.new_source is None and out.reason.startswith("no-op")


def test_empty_search_is_rejected():
    out = apply_edits(SOURCE, [EditBlock("\n  \n", "x = 1")])
    assert out.new_source is None and "SEARCH section is empty" in out.reason


def test_apply_answer_handles_edits_programs_and_nothing():
    edited = apply_answer(SOURCE, block("    BLOCK_N = 64", "    BLOCK_N = 128"), "python")
    assert "BLOCK_N = 128" in edited.new_source and edited.applied == 1
    whole = apply_answer(SOURCE, "```python\ndef attention(q, k, v, causal):\n    return q\n```", "python")
    assert whole.new_source == "def attention(q, k, v, causal):\n    return q\n" and whole.applied == 0
    same = apply_answer(SOURCE, f"```python\n{SOURCE}```", "python")
    assert same.new_source is None and same.reason.startswith("no-op")
    assert apply_answer(SOURCE, "no code today", "python").reason == NO_ANSWER


# ---- diffs --------------------------------------------------------------

def test_summarise_change_is_a_unified_diff():
    new = SOURCE.replace("BLOCK_M = 64", "BLOCK_M = 128")
    diff = summarise_change(SOURCE, new)
    assert diff.startswith("--- parent\n+++ child\n")
    assert "-    BLOCK_M = 64" in diff and "+    BLOCK_M = 128" in diff


def test_summarise_change_caps_long_diffs():
    old = "".join(f"line {i}\n" for i in range(200))
    new = "".join(f"LINE {i}\n" for i in range(200))
    diff = summarise_change(old, new, max_lines=60).split("\n")
    assert len(diff) == 61 and diff[-1].startswith("... (") and "more diff lines" in diff[-1]
