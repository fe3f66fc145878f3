"""Countdown with StarPO-S: RAGEN v1's ``_4_countdown.yaml`` (ragen-reference.md §1.4).

Train and validate on ``Countdown``: use each of 3-4 numbers once in an arithmetic expression that
equals the target, answered as ``<answer>2 + 5 - 3</answer>`` (a language action: the answer text
itself is scored, in the graph, by RAGEN's rule: 1.0 right, 0.1 right numbers, else 0). One turn
with one answer (``max_turn`` 1, ``max_actions_per_turn`` 1; envs.yaml: one action per episode),
otherwise ``configs/base.py`` (8 groups x 16 rollouts, keep 25 %, GAE, 400 new tokens, 256 fixed
validation tasks from seed 123).

Tasks are drawn in JAX (3-4 numbers from 1 to 99 and a target that some choice of signs reaches,
the kind RAGEN's ``has_solution`` filter keeps). RAGEN reads them from Countdown-Tasks-3to4
instead; to do the same, pass the data set as a local file (or ``hub:`` with network):

    python -m experiments.run --config configs/countdown.py
    python -m experiments.run --config configs/countdown.py --config.envs.overrides.Countdown.tasks=train.parquet
"""

from configs import base

CHANGES = {
    "envs.train.tags": ("Countdown",),
    "envs.val.tags": ("Countdown",),
    # Countdown's constructor keywords (envs_jax/countdown.py): "" draws tasks in JAX; a .jsonl /
    # .json / .parquet path or "hub:Jiayi-Pan/Countdown-Tasks-3to4" reads RAGEN's data set.
    "envs.overrides": {"Countdown": dict(tasks="", max_instances=20000)},
    "rollout.max_turn": 1,
    "rollout.max_actions_per_turn": 1,
    "trainer.output_dir": "runs/countdown",
}


def get_config():
    return base.with_overrides(base.get_config(), CHANGES)
