import numpy as np
import pytest
from gymnasium.utils import seeding

from envs_jax.seeding import gymnasium_rng


def test_rng_is_gymnasiums_np_random():
    for seed in (0, 123, 2**40):
        ours, theirs = gymnasium_rng(seed), seeding.np_random(seed)[0]
        np.testing.assert_array_equal(ours.random(5), theirs.random(5))
    with pytest.raises(ValueError, match="non-negative"):
        gymnasium_rng(-1)
