"""SWE agents: SWE-bench-format tasks, workspaces where the agent's bash commands run, grading by
the task's tests, and the bash agent protocol (ALGORITHM.md's coding setting, DIS band 0.2..4.0)."""
