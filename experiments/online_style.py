"""Online learning: the rewarded writing style switches at steps 150 and 300 (ALGORITHM.md §6).

Hypothesis: SAO re-aligns within tens of steps after each switch, while the running-mean baseline
(a global window of the last 128 rewards) lags and plateaus lower. The environment
(`sao_jax.envs.style_shift`) judges a one-sentence answer about a topic by its form and by the
punctuation of the style in force at the learner step the prompt was leased at.

    make train EXP=online_style
    make train EXP=online_style ARGS='--config.algo=running_mean --workdir=runs/online_style_rm'

Compare `reward/mean` of the two runs in TensorBoard around steps 150 and 300. The toy model is
warm-started on a teacher that writes well-formed sentences ending in a style drawn at random
(`style_shift.teacher_sentence`), so each style starts at about a third of the reward and RL has
to find, and later re-find, the one in force. About 2 minutes on 2 CPU cores once the warm start
is cached.

Measured with SAO (2 cores, 25-step means of reward/mean): 0.55, 0.93, 0.97, 0.98, 0.99, 0.98;
after the switch at step 150: 0.00, 0.00, 0.10, 0.82, 0.91, 0.93; after the switch at step 300:
0.00 to the end. The policy's end punctuation collapses onto the rewarded style, so after the second
switch the new one is never sampled. With policy lr 1e-3 the first switch was re-learned only to
0.57, hence 3e-4 here. Single runs of two variants: policy lr 1e-4 learned the first style slower
and did not re-learn the second (0.01 at steps 150-300), but began on the third (0.13 at the
end); critic lr 1e-3 did not re-learn the second but did the third (0.30, 0.90, 0.96). Whether a
switch is re-learned depends on sampling the new style before its probability has collapsed;
there is no entropy term to keep it alive. The toy does not yet show the paper's quick
re-alignment twice.
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
    config.rl.global_baseline = True  # for --config.algo=running_mean: the online variant
    config.optim.policy.learning_rate = 3e-4  # 1e-3 collapses the style faster (docstring)
    config.optim.critic.learning_rate = 3e-3

    config.env.name = "style_shift"
    config.env.max_turns = 1
    config.env.max_action_tokens = 48
    config.env.max_response_tokens = 48
    config.env.num_train_prompts = 512
    config.env.num_eval_prompts = 100

    config.rollout.engine_max_seq_len = 127  # prompt + response: learner rows of <= 128
    config.pack_rows = False  # short rows, as in toy.py: packing does not pay here
    return config
