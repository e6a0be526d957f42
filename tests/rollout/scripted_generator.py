"""A generator that answers from a script instead of a model: the worker and registry tests play
episodes with it, with known actions, log-probs and versions."""

from sao_jax.rollout.client import GenerateResult


class ScriptedGenerator:
    """Returns the next scripted action encoded by `tok`, with log-prob -0.5 and version 1."""

    def __init__(self, tok, actions):
        self.tok, self.actions, self.calls = tok, list(actions), []

    async def generate(self, input_ids, sampling_params, rid=None):
        self.calls.append((list(input_ids), dict(sampling_params)))
        ids = self.tok.encode(self.actions.pop(0))
        return GenerateResult(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                              weight_versions=["1"] * len(ids), prompt_tokens=len(input_ids),
                              completion_tokens=len(ids))
