"""The documents: README.md stays short, their links resolve, and the configuration reference
they print is the code's defaults."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from evoattn.config import RunConfig, config_from_dict, config_to_dict

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "BENCHMARKS.md", "docs/GUIDE.md", "docs/PROTOCOL.md"]
README_MAX_BYTES = 15_000          # a README a newcomer reads in five minutes


def _anchors(path: Path) -> set[str]:
    """Returns the GitHub anchors of a Markdown file's headings."""
    heads = (line.lstrip("#").strip().lower() for line in path.read_text().splitlines()
             if line.startswith("#"))
    return {re.sub(r"[^\w\- ]", "", h).replace(" ", "-") for h in heads}


def _yaml_block(path: Path, heading: str) -> dict:
    """Returns the first ```yaml block after a heading, parsed."""
    text = path.read_text()
    start = text.index("```yaml", text.index(heading)) + len("```yaml")
    return yaml.safe_load(text[start:text.index("```", start)])


def _keys(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _keys(v, f"{prefix}{k}.")
    return out


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= README_MAX_BYTES


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_reach_a_file_and_heading(doc: str) -> None:
    path = ROOT / doc
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if link.startswith(("http://", "https://")):
            continue
        target, _, anchor = link.partition("#")
        dest = (path.parent / target).resolve() if target else path
        if not dest.exists() or (anchor and dest.suffix == ".md"
                                 and anchor not in _anchors(dest)):
            broken.append(link)
    assert not broken, f"{doc}: {broken}"


def test_configuration_reference_is_the_codes_defaults() -> None:
    """README's keys plus GUIDE's other keys load to RunConfig() and leave no key out."""
    raw = _yaml_block(ROOT / "README.md", "## Configuration")
    more = _yaml_block(ROOT / "docs/GUIDE.md", "## Configuration keys not in the README")
    raw["evaluator"].update(more["evaluator"])
    raw["llm"] = more["llm"]
    documented = config_to_dict(config_from_dict(raw, "README.md"))
    defaults = config_to_dict(RunConfig())
    assert documented == defaults
    assert _keys(defaults) <= _keys(raw)
