"""StarPO-S on a multi-turn env: the bundled SmolLM2-135M-Instruct on FrozenLake.

    .venv/bin/python -m experiments.run --config configs/learn_frozen_lake.py

RAGEN's FrozenLake as ``configs/frozen_lake.py`` has it (4×4 lakes, slippery ice, 10 actions per
episode), played over up to 5 turns. The settings are ``configs/learn_bandit.py``'s ``RECIPE``, for the same
reasons (GRPO on rewards minus the group mean, answer-only turns, full weights in float32, log-probs
from the sampler, a group per micro-batch); validation on 128 fixed levels before, half-way and
after training. On the shared 2-core CPU one 64-level validation chunk took 13 minutes (load 7-8):
each turn prefills every row's new observation, so a step costs ~10-20 minutes there and 20 steps do
not fit an hour; docs/results.md has the figures and the smaller run to try next.
"""

from configs import base, frozen_lake, learn_bandit

CHANGES = {
    **frozen_lake.CHANGES,
    **learn_bandit.RECIPE,
    "envs.train.n_groups": (8,),
    "filter.ratio": 0.5,
    "envs.val.n_groups": (128,),
    "rollout.max_turn": 5,
    "rollout.response_length": 24,
    "rollout.max_model_len": 768,
    "trainer.total_steps": 20,
    "trainer.test_freq": 10,
    "trainer.log_trajectories": 4,
    "trainer.val_chunks": 2,
    "trainer.output_dir": "runs/learn_frozen_lake",
}


def get_config():
    return base.with_overrides(base.get_config(), CHANGES)
