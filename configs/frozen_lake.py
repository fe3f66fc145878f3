"""FrozenLake with StarPO-S: RAGEN v1's ``_3_frozen_lake.yaml`` (train and validate on FrozenLake).

Reproduces the StarPO-S FrozenLake curves (paper Fig. 9; Figs. 5, 7, 8 with presets): 4×4 lakes
whose cells are frozen with probability 0.8 (else holes), on slippery ice (the agent moves the
intended way or either perpendicular way, 1/3 each), otherwise the Sokoban defaults of
``configs/base.py`` — 8 groups × 16 rollouts, keep 25 %, GAE, clip 0.2/0.28, no KL, 256 fixed
validation levels. (Later RAGEN versions switched this file to a "CoordFrozenLake" tag; v1 and the
paper use FrozenLake.)

    python -m experiments.run --config configs/frozen_lake.py
    python -m experiments.run --config configs/presets.py:frozen_lake+starpo_ppo   # vanilla StarPO
"""

from configs import base

CHANGES = {
    "envs.train.tags": ("FrozenLake",),
    "envs.val.tags": ("FrozenLake",),
    "trainer.output_dir": "runs/frozen_lake",
}


def get_config():
    return base.with_overrides(base.get_config(), CHANGES)
