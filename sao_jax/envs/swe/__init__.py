"""SWE agents: SWE-bench-format tasks, workspaces where the agent's bash commands run, grading by
the task's tests, and the bash agent protocol (the coding DIS band 0.2..4.0: docs/algorithm.md
§1)."""
