"""StarPO-S on a multi-turn env: the bundled SmolLM2-135M-Instruct on FrozenLake.

    .venv/bin/python -m experiments.run --config configs/learn_frozen_lake.py

RAGEN's FrozenLake as ``configs/frozen_lake.py`` has it (4×4 lakes, slippery ice, up to 5 actions a
turn and 10 an episode, RAGEN's prompt), with ``configs/learn_bandit.py``'s ``RECIPE`` (GRPO, no KL,
clipping 0.2 / 0.28, full weights in float32, log-probs from the sampler, lr 3e-5). What differs,
and why (docs/results.md §4 has the measurements):

- ``<think>`` stays on (RAGEN's default). With answer-only turns the untrained model wrote no valid
  action in 768 sampled first turns (3 levels × 128, temperatures 1.0 and 1.5): after the forced
  ``<answer>`` it rambles about the legend. With ``<think>`` it sometimes copies the prompt's
  example (``… I should go left then go up.</think><answer>Left || Up</answer>``): 2 turns in 384
  at temperature 1.0, none in 256 at 1.5. Rare, but the reward-variance filter finds the group;
- GRPO's advantages as RAGEN computes them, divided by the group's reward std (the Bandit preset
  leaves the std out, for a reason particular to its payoffs): the first signal is a rare valid
  turn (format penalty −0.1 avoided) in an otherwise unanimous group, and dividing by the std
  makes that member's push ~2.5 whatever the penalty's scale, instead of ~0.09;
- 48 new tokens a turn (the example alone is ~30), 3 turns (RAGEN: 5; up to 5 actions a turn, so the
  10-action budget can still be spent), a 640-token context: ~275 first-prompt tokens, ~90 per later
  turn's prompt, 48 per response;
- 8 groups of 8 per step (192 turns, where a valid one is rare), the filter keeping the top 25 %
  (2 groups, 16 rows; the paper's ratio): each turn prefills every row's new observation and the
  update reads whole multi-turn rows, so 16 rows keep the update within a few minutes on 2 cores;
- micro-batches of one group (8 rows), nothing rematerialised (the recipe's ``model.remat=none``):
  the update computes each distinct first prompt of a micro-batch once, so each kept group's prompt
  is computed once where micro-batches of 4 rows (half a group) computed it twice, in products of
  twice the rows (docs/benchmarks.md, "FrozenLake's update in micro-batches of one group"); keeping the
  attention's activations costs the host a few GiB more than recomputing them (``model.remat=dots``)
  and saves the update that work (docs/benchmarks.md, "The FrozenLake preset's update without
  rematerialisation …"). Micro-batches of 8 rows need more host memory than of 4, and the
  planner stops a run at its start where too little is available (the figures are in that
  section): ``--config.actor.micro_batch_size=4`` computes the same update, a little slower;
- validation on 64 fixed levels (seeds 123-186) before, half-way and after 16 steps.
"""

from configs import base, frozen_lake, learn_bandit

CHANGES = {
    **frozen_lake.CHANGES,
    **learn_bandit.RECIPE,
    "rollout.enable_think": True,
    "reward.method": "identity",
    "algorithm.grpo_norm_by_std": True,
    "envs.train.n_groups": (8,),
    "filter.ratio": 0.25,
    "actor.ppo_mini_batch_size": 16,
    "actor.micro_batch_size": 8,
    "envs.val.n_groups": (64,),
    "rollout.max_turn": 3,
    "rollout.response_length": 48,
    "rollout.max_model_len": 640,
    "trainer.total_steps": 16,
    "trainer.test_freq": 8,
    "trainer.log_trajectories": 4,
    "trainer.val_chunks": 1,
    "trainer.output_dir": "runs/learn_frozen_lake",
}


def get_config():
    return base.with_overrides(base.get_config(), CHANGES)
