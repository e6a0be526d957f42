"""Multi-turn environments: text in, text out; the agent loop tokenises (`tokenizer.py` for the toy
vocabulary). `envs/` knows nothing of models."""
