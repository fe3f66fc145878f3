"""Quick start: three StarPO-S (GRPO) steps on the Bandit with the bundled SmolLM2-135M-Instruct.

Runs offline on 2 CPU cores in minutes (docs/benchmarks.md has measured times). It checks the whole pipeline (rollout, filter, advantages, update,
validation, logging); it does not reproduce a paper number, since 135M parameters and three steps
learn nothing measurable. Sizes:

- train: 2 Bandit groups x 4 rollouts = 8 trajectories, no filtering (ratio 1.0), GRPO (no critic,
  half the compute of PPO), one mini-batch of 8 in micro-batches of 4;
- validation: 4 Bandit + 4 BanditTest levels, before training and after the last step
  (``test_freq`` = ``total_steps`` = 3);
- answer-only turns (``enable_think=False``): a 135M model does not close a ``<think>`` block
  within a few dozen tokens, so every response would be a format failure, every group's rewards
  equal and every GRPO advantage zero; answering directly it names an arm often enough for the
  update to get a signal;
- 48 new tokens per turn, 320 tokens per trajectory (the Bandit prompt is at most 225 SmolLM2
  tokens; the update's cost grows with this length); float32, since bfloat16 runs slower
  under XLA:CPU (docs/benchmarks.md, "A bfloat16 update on CPU").

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
    "rollout.enable_think": False,
    "rollout.response_length": 48,
    "rollout.max_model_len": 320,
    "actor.ppo_mini_batch_size": 8,
    "actor.micro_batch_size": 4,
    "trainer.total_steps": 3,
    "trainer.test_freq": 3,
    "trainer.log_trajectories": 4,
    "trainer.output_dir": "runs/quickstart",
}


def get_config():
    return base.with_overrides(bandit.get_config(), CHANGES)
