"""RAGEN's seeded levels on the host: the generator gymnasium builds for a seed.

RAGEN's Bandit and FrozenLake draw their level (arm order, map) from ``gymnasium.utils.seeding.
np_random(seed)``; ``reset_from_seed`` uses the same generator, without gymnasium, so a seed gives
RAGEN's level.
"""

from __future__ import annotations

import numpy as np


def gymnasium_rng(seed: int) -> np.random.Generator:
    """The generator ``gymnasium.utils.seeding.np_random(seed)`` returns (PCG64 via SeedSequence)."""
    if not (isinstance(seed, (int, np.integer)) and seed >= 0):
        raise ValueError(f"Seed must be a non-negative integer, got {seed!r}.")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed))))
