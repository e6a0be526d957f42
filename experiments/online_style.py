"""Online learning: the rewarded sentence length switches at steps 150 and 300
(docs/algorithm.md §6).

Hypothesis: SAO re-aligns within tens of steps after each switch, while the running-mean baseline
(a global window of the last 128 rewards) lags and plateaus lower. The environment
(`sao_jax.envs.style_shift`) judges a one-sentence answer about a topic by its form and by how
close its length is to the style in force at the learner step the prompt was leased at: terse (3
words), then balanced (5) from step 150, then terse again from step 300
(`env.style_schedule`), the reward falling off by a sixth per word off the target. Balanced, not
the env's default wordy (7): after a switch to wordy only 1 of 6 runs got back to 80% of its
pre-switch reward within the 150 steps (the toy model's 7-word sentences break more rules), so
the first switch could not compare how fast the algorithms recover; after balanced every run
does (experiments/notebooks/online_switch.py).

    make train EXP=online_style
    make train EXP=online_style ARGS='--config.algo=running_mean --workdir=runs/online_style_rm'

Compare `reward/mean` of the two runs around steps 150 and 300 (experiments/notebooks/
online_switch.py measures the steps to recover). The toy model is warm-started on a teacher that
writes well-formed sentences of 3 to 10 words, the length drawn uniformly
(`style_shift.teacher_sentence`), so RL has to find, and later re-find, the length in force.

Measured with SAO (2 cores, beside other runs; 10-step means of reward/mean): 0.37 at step 10,
0.77 at 50, 0.87 at 100, 0.87 at 150; after the switch to balanced 0.61, 0.71 at 181 (80% of the
pre-switch level 31 steps after the switch), 0.78 at 220, 0.80 at 260; after the switch back to
terse 0.72, 0.87 at 320, 0.95 at 350, 0.99 at 450. With wordy in the middle instead, the same run
fell to 0.31 and reached only 0.69 by step 290. About 4-6 minutes of RL after a 1000-step warm
start (~12 minutes, cached). Earlier settings that failed are in `style_shift`'s docstring.
"""

from experiments import base


def get_config():
    config = base.get_config()
    config.name = "online_style"
    config.total_steps = 450
    config.batch_size = 32
    config.max_staleness = 1  # the target moves: stay close to on-policy
    config.checkpoint_every = 50

    config.model.preset = "toy"
    config.warm_start.enabled = True
    # Most of the held-out loss is the teacher's own randomness (words and lengths drawn at
    # random): 0.84 at step 200, 0.72 at 400, 0.67 at 1100, 0.655 at 2000, never flat enough
    # for the plateau rule. 1000 steps write well-formed sentences of every length.
    config.warm_start.max_steps = 1000
    config.rl.global_baseline = True  # for --config.algo=running_mean: the online variant
    config.optim.policy.learning_rate = 3e-4  # 1e-3 lost the punctuation style faster
    config.optim.critic.learning_rate = 3e-3
    # Its committed runs bootstrapped cut episodes (the base default); kept to compare with them
    # (docs/algorithm.md, on truncation).
    config.rl.bootstrap_truncated = True

    config.env.name = "style_shift"
    config.env.style_schedule = "0:terse,150:balanced,300:terse"
    config.env.max_turns = 1
    # A sentence cut at 48 tokens is still judged (a response budget above the action's: an
    # action cut by the budget itself never reaches the judge and earns 0, a cliff that run-ons
    # fell off in one run and never came back from)
    config.env.max_action_tokens = 48
    config.env.max_response_tokens = 64
    config.env.num_train_prompts = 512
    config.env.num_eval_prompts = 100

    config.rollout.engine_max_seq_len = 127  # prompt + response: learner rows of <= 128
    config.pack_rows = False  # short rows, as in toy.py: packing does not pay here
    return config
