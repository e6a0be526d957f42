"""The ablation testbed (chain.py) with a 4-layer policy, so that its critic (the policy's copy
with a value head) is deep enough for frozen attention to matter.

Hypothesis (docs/algorithm.md §6): freezing the critic's attention lowers its gradient norm and
the spread of its value loss. chain's 2-layer critic cannot test it: n=8 runs each gave mean
critic gradient norms of 0.587 (frozen, sao) and 0.603 (all parameters, sao_full_critic), a
difference inside the noise (SE 0.015), with one attention block of two to freeze.

The warm start is chain's teacher at this depth, shipped in experiments/data/warm_starts: it
stopped at its plateau after 2400 steps (held-out loss 0.223, against chain's 0.247 after 4000),
54 minutes on 2 cores beside other runs. RL starts from 0.51 held-out Pass@1 (greedy 0.575),
where chain starts from 0.30.

Measured (experiments/notebooks/critic_depth.ipynb, 8 seeds each): per run, the critic's mean
gradient norm 0.450 (frozen) against 0.475 (all parameters), 5% higher with everything trained
(+0.024, SE 0.012; Welch's t 2.06, p 0.062, Holm 0.43: not shown); its spread over the steps
(0.463 against 0.464), the value loss (0.033 against 0.034) and the loss's spread do not differ.
The policy ends near 0.92 held-out Pass@1 either way. In two more full-critic runs the
attention's own gradient (`critic/attention_grad_norm`) was 1.6-2.3% of the critic's gradient
norm: freezing it removes almost nothing from the norm at this scale.

    make train EXP=chain_deep
    make train EXP=chain_deep ARGS='--config.algo=sao_full_critic --workdir=runs/chain_deep_full'
"""

from experiments import chain


def get_config():
    config = chain.get_config()
    config.name = "chain_deep"
    config.model.num_layers = 4
    return config
