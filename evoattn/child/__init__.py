"""The child: runs one untrusted candidate in a process of its own.

The orchestrator imports from here only what it times or checks in trusted code of its own
(benchmarks, `evoattn eval`'s station); what both sides share is `evoattn.contract`.
"""
