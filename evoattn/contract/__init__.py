"""What the orchestrator and a candidate's process share: the request, results, names,
program and knob parsing, and the build runtime."""
