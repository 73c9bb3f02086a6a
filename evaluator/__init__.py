"""The evaluator: runs one untrusted candidate in a child process of its own.

Nothing in this package is imported by the orchestrator except `evaluator.types`
(plain data) and `evaluator.problems` metadata (names, configs, contracts).
"""
