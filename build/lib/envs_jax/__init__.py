"""Pure-JAX text environments with RAGEN semantics: Bandit, FrozenLake, Sokoban."""

from envs_jax.registry import VARIANTS, make

__all__ = ["VARIANTS", "make"]
