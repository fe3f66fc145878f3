"""Pure-JAX text environments with RAGEN semantics: Bandit, FrozenLake, Sokoban, Countdown.

A new environment is one file: a ``envs_jax.base.TextEnv`` subclass (the contract), then
``envs_jax.register("Name", MyEnv)`` or a class path ``"mypkg.myenv:MyEnv"`` wherever an env name
goes (see docs/environments.md).
"""

from envs_jax.registry import VARIANTS, default_max_actions_per_traj, is_known, known_names, make, register

__all__ = ["VARIANTS", "default_max_actions_per_traj", "is_known", "known_names", "make", "register"]
