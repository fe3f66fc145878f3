"""SimpleSokoban with StarPO-S: RAGEN's ``_2_sokoban.yaml``, which is ``base.yaml`` unchanged.

Reproduces the StarPO-S Sokoban curves (paper Fig. 9, and the keep-25 % run of Fig. 7): 6×6 rooms
with one box, 8 groups × 16 rollouts, the top 25 % of groups by reward std kept, GAE with a
critic, clip 0.2/0.28, no KL; validation on 256 fixed levels (seeds 123…378) at temperature 0.5.
Every value is ``configs/base.py``; the paper's other Sokoban runs are presets
(``configs/presets.py``, docs/configs.md).

    python -m experiments.run --config configs/sokoban.py
"""

from configs import base

CHANGES = {"trainer.output_dir": "runs/sokoban"}


def get_config():
    return base.with_overrides(base.get_config(), CHANGES)
