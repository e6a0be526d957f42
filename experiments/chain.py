"""The ablation testbed: calculator chains of four dependent tool calls, a sparse outcome reward.

Hypothesis (ALGORITHM.md §6 at toy scale): with credit to assign across several turns, a learned
token-level value (SAO) beats group baselines (GRPO+DIS) and a running mean, and DIS keeps
off-policy training stable where PPO against a recomputed old policy does not.

Why it should have headroom: each problem, e.g. `(12+7)*3-5*21=?`, takes four tool calls
whose operands are earlier results, so one miscopied digit anywhere fails the episode; the warm
start imitates a teacher that guesses the answer without the tool on half of its transcripts, and
the 0.1M-parameter policy copies long intermediate results imperfectly even when it uses the tool.

    make train EXP=chain
    make train EXP=chain ARGS='--config.algo=grpo_dis --workdir=runs/chain_grpo_dis'
"""

from experiments import toy


def get_config():
    config = toy.get_config()
    config.name = "chain"
    config.total_steps = 300
    config.eval_every = 50
    config.warm_start.guess_rate = 0.5
    config.env.num_ops = 4
    config.env.max_turns = 6  # four tool calls and the answer, one turn to spare
    return config
