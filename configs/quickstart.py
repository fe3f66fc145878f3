"""Quick start: three StarPO-S (GRPO) steps on the Bandit with the bundled SmolLM2-135M-Instruct.

Runs offline in a few minutes on 2 CPU cores: it checks the whole pipeline (rollout, filter,
advantages, update, validation, logging), it does not reproduce a paper number — 135M parameters
and three steps learn nothing measurable. Sizes:

- train: 2 Bandit groups x 4 rollouts = 8 trajectories, no filtering (ratio 1.0), GRPO (no critic,
  half the compute of PPO), one mini-batch of 8 in micro-batches of 4;
- validation: 4 Bandit + 4 BanditTest levels, before training and after the last step
  (``test_freq`` = ``total_steps`` = 3);
- 64 new tokens per turn, 512 tokens per trajectory (the Bandit prompt is about 225 SmolLM2
  tokens); float32, since CPUs gain nothing from bfloat16.

    python -m experiments.run --config configs/quickstart.py
"""

from configs import bandit, base, presets

CHANGES = {
    **presets.PRESETS["starpo_s_grpo"],
    "model.source": "smollm2-135m-instruct",
    "model.dtype": "float32",
    "envs.train.n_groups": (2,),
    "envs.train.group_size": 4,
    "envs.val.n_groups": (4, 4),
    "filter.ratio": 1.0,
    "rollout.response_length": 64,
    "rollout.max_model_len": 512,
    "actor.ppo_mini_batch_size": 8,
    "actor.micro_batch_size": 4,
    "trainer.total_steps": 3,
    "trainer.test_freq": 3,
    "trainer.log_trajectories": 4,
    "trainer.output_dir": "runs/quickstart",
}


def get_config():
    return base.with_overrides(bandit.get_config(), CHANGES)
