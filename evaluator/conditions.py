"""The `when(...)` grammar that gates knobs and companion files on knob values and run facts.

    when(PATH=a, PATH=b)              one group: any of its terms holds
    when(@target=sm90) when(X!=1)     several groups: all must hold
Terms are NAME=VALUE or NAME!=VALUE. A NAME starting with @ is a fact about the run that the
caller passes in (`@target`: "cpu", or "smXY" for the GPU's compute capability); any other
NAME is a knob of the program. A fact that was not given, or a knob the program does not
have, counts as holding: an unknown term never rules anything out.
"""
from __future__ import annotations

import re
from typing import Mapping

Term = tuple[str, str, str]            # (name, "=" or "!=", value)
Group = tuple[Term, ...]               # alternatives
Conditions = tuple[Group, ...]         # all must hold

_WHEN = re.compile(r"\bwhen\((?P<conds>[^)]*)\)")
_TERM = re.compile(r"^\s*(?P<name>@?\w+)\s*(?P<op>!=|=)\s*(?P<value>\S+?)\s*$")


def parse(text: str) -> Conditions:
    """Returns the when(...) groups found in text (malformed terms are ignored)."""
    groups = []
    for m in _WHEN.finditer(text):
        terms = [t for t in (_TERM.match(c) for c in m.group("conds").split(",")) if t]
        if terms:
            groups.append(tuple((t["name"], t["op"], t["value"]) for t in terms))
    return tuple(groups)


def holds(conditions: Conditions, values: Mapping[str, str],
          facts: Mapping[str, str] | None = None) -> bool:
    """Returns whether every group has a term that holds for these knob values and facts."""
    facts = facts or {}

    def term(name: str, op: str, value: str) -> bool:
        have = facts.get(name[1:]) if name.startswith("@") else values.get(name)
        if have is None:
            return True
        return (have == value) == (op == "=")

    return all(any(term(*t) for t in group) for group in conditions)
