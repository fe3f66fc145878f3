"""Bi-Arm Bandit with StarPO-S: RAGEN's ``_1_bandit.yaml``.

Train on ``Bandit`` (arms Phoenix / Dragon), validate on ``Bandit`` and ``BanditTest`` (Trader /
Librarian), 256 levels each: one turn with one action (``max_turn`` 1, ``max_actions_per_turn``
1), 500 new tokens per turn, otherwise ``configs/base.py``. Reproduces the StarPO-S Bandit curve
(paper Fig. 9); with presets, vanilla StarPO on Bandit (Fig. 5) and the reasoning-generalisation
runs with Engineer / Teacher arms (``bandit_normal``, ``bandit_rev``, Table 4, Fig. 11).

The arms' names and payoffs are listed under ``envs.overrides`` so they can be changed on the
command line, e.g. ``--config.envs.overrides.Bandit.lo_arm_name=Engineer``.

Quirk 16 (replicated): the low-risk arm pays 0.1, as RAGEN's code does; the paper says 0.15
(``--config.envs.overrides.Bandit.lo_arm_score=0.15`` gives the paper's number).

    python -m experiments.run --config configs/bandit.py
"""

from configs import base


def _arms(lo: str, hi: str) -> dict:
    return dict(lo_arm_name=lo, hi_arm_name=hi, lo_arm_score=0.1)


CHANGES = {
    "envs.train.tags": ("Bandit",),
    "envs.val.tags": ("Bandit", "BanditTest"),
    "envs.val.n_groups": (256, 256),
    "envs.overrides": {"Bandit": _arms("Phoenix", "Dragon"), "BanditTest": _arms("Trader", "Librarian")},
    "rollout.max_turn": 1,
    "rollout.max_actions_per_turn": 1,
    "rollout.response_length": 500,
    "trainer.output_dir": "runs/bandit",
}


def get_config():
    return base.with_overrides(base.get_config(), CHANGES)
