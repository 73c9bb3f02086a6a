"""Mutators: ways of proposing a child program from a parent.

Modules are imported by their users (`evoattn.mutators.llm`, `.knobs`), not
here, so that importing the package never pulls in the `openai` client.
"""
