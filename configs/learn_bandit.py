"""StarPO-S that learns on a CPU: the bundled SmolLM2-135M-Instruct learns to pull the Bandit's risky arm.

    .venv/bin/python -m experiments.run --config configs/learn_bandit.py

The Bandit's risky arm (Dragon) pays 1 with probability 0.25, else 0 (expected 0.25); the safe arm
(Phoenix) pays 0.1 every time (RAGEN's code; the paper says 0.15). Success is choosing the risky
arm. Before training the model mostly names the safe arm and often fails the answer format; this
preset trains it for 20 steps with validation on 256 Bandit and 256 BanditTest levels (the renamed
arms, the paper's generalisation test) before, half-way and after training. docs/results.md §1 has
its runs, their wall times and success rates: every seed learns the format, two of three learn the
risky arm, and the third stops half-way (the policy picks the risky arm on some levels and the safe
one on others, every group unanimous: the Echo Trap per level).

Choices, each for the budget or for what the probe runs showed (docs/results.md):

- StarPO-S with GRPO (no critic: half the compute of PPO), asymmetric clipping 0.2 / 0.28, no KL;
- 16 groups of 8 per step, the reward-variance filter keeping the top 25 % (4 groups, the paper's
  ratio): the untrained model pulls the risky arm in ~3 % of answers and it pays in a quarter of
  pulls, so a step needs many candidate groups for the filter to find the few where it paid. With
  8 groups and the filter at 50 % (the same 32 rows per update), two seeds of three fell into the
  Echo Trap on the safe arm within 5 steps; with 16 and 25 %, none did, though one stopped half-way
  (docs/results.md);
- groups of 8 (not 4): small groups rarely see the risky arm's payout, and once every member
  answers alike the group has no signal (the Echo Trap in small);
- advantages are rewards minus the group mean, not divided by the group's std
  (``reward.method=mean``, ``algorithm.grpo_norm_by_std=False``, as Dr. GRPO): with the std, a
  group where the risky arm did not pay (rewards 0 and 0.1, a tiny std) pushes the safe arm as hard
  as a group where it paid pushes the risky one, and since it does not pay three times in four the
  expected update favours the safe arm, which is what a probe with the std converged to;
- answer-only turns (``enable_think=False``): the 135M model does not close a ``<think>`` block
  within a few dozen tokens; 16 new tokens per turn: it names an arm in its first few tokens
  (`` Phoenix </answer>``) and then rambles on until the budget cuts it, so a longer budget only
  costs decode steps and update width;
- full weights in float32 (bfloat16 runs slower under XLA:CPU: docs/benchmarks.md), no
  rematerialisation (the update's memory is small), log-probs from the sampler (no recomputation
  pass);
- the 32 kept rows in one micro-batch: the update computes each distinct first prompt of a
  micro-batch once (``forward.UpdateLayout``), and the Bandit's levels show two (its arms in either
  order), so one micro-batch of 4 groups computes 2 prompts where 4 micro-batches of one group
  each computed 4: the update ~1.4× faster (docs/benchmarks.md);
- the learning rate from ``experiments.sweep`` (docs/results.md).
"""

from configs import bandit, base, presets

# The recipe, env apart (configs/learn_frozen_lake.py uses it too).
RECIPE = {
    **presets.PRESETS["starpo_s_grpo"],
    "model.source": "smollm2-135m-instruct",
    "model.dtype": "float32",
    "model.remat": "none",
    "envs.train.group_size": 8,
    "reward.method": "mean",
    "algorithm.grpo_norm_by_std": False,
    "rollout.enable_think": False,
    "rollout.use_sampler_logprobs": True,
    "actor.lr": 3e-5,
    "actor.ppo_mini_batch_size": 32,
}

CHANGES = {
    **bandit.CHANGES,
    **RECIPE,
    "envs.train.n_groups": (16,),
    "filter.ratio": 0.25,
    "actor.micro_batch_size": 32,
    "envs.val.n_groups": (256, 256),
    "rollout.response_length": 16,
    "rollout.max_model_len": 256,
    "trainer.total_steps": 20,
    "trainer.test_freq": 10,
    "trainer.log_trajectories": 8,
    "trainer.val_chunks": 4,  # 128 levels per rollout: 1.9 GB of KV cache instead of 7.5
    "trainer.output_dir": "runs/learn_bandit",
}


def get_config():
    return base.with_overrides(base.get_config(), CHANGES)
