"""The fault suite (`make test-faults`): real toy runs with two engines and two workers, each
with one fault injected. Marked `faults`, which `pytest tests` (and so `make test`) deselects
(pyproject.toml): a few minutes of learner runs."""
