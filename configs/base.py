"""RAGEN v1 defaults (StarPO-S on SimpleSokoban with Qwen2.5-0.5B-Instruct).

Every value here is the original's effective default (spec: ragen-v1-spec.md §2.1, §3.1-3.7), unless
a comment says otherwise. Env files (``sokoban.py``, ``frozen_lake.py``, ``bandit.py``) and
``presets.py`` start from ``get_config()`` and override. Override any key on the command line:
``python -m experiments.run --config configs/sokoban.py --config.rollout.max_turn=3``.
"""

import copy
from collections.abc import Mapping
from typing import Any

from ml_collections import ConfigDict


def env_split(tags, n_groups, group_size, seed):
    """One side (train or val) of the env manager: which tags, how many groups each, seeds."""
    return ConfigDict(
        dict(
            tags=tuple(tags),
            n_groups=tuple(n_groups),
            group_size=group_size,
            seed=seed,
        )
    )


def with_overrides(config: ConfigDict, changes: Mapping[str, Any]) -> ConfigDict:
    """A copy of ``config`` with ``changes`` ({"section.key": value}) applied in order.

    Every key must already exist (ConfigDict would silently add a misspelt one); a whole section
    such as ``envs.overrides`` may be replaced by a dict.
    """
    config = copy.deepcopy(config)
    for path, value in changes.items():
        *parents, key = path.split(".")
        node = config
        for name in [*parents, key]:
            if not isinstance(node, ConfigDict) or name not in node:
                raise ValueError(f"Config key {path!r} does not exist; check its spelling against configs/base.py.")
            parent, node = node, node[name]
        parent[key] = value
    return config


def get_config() -> ConfigDict:
    c = ConfigDict()
    c.model = ConfigDict(
        dict(
            # A hub id, a local Hugging Face folder, a GGUF file, or "smollm2-135m-instruct".
            source="Qwen/Qwen2.5-0.5B-Instruct",
            # Random weights of a named preset instead of a checkpoint (tests, benchmarks).
            random_init_preset="",
            dtype="bfloat16",  # compute dtype; master weights stay float32
            # The update's backward pass recomputes each layer ("layer"), or keeps all ("none"),
            # or keeps the projections too ("dots"): docs/scaling.md.
            remat="layer",
            # A Jinja chat template replacing the tokenizer's ("" keeps it); the rollout needs one
            # that renders past messages verbatim (ChatML: Qwen2.5, SmolLM2).
            chat_template="",
        )
    )
    c.envs = ConfigDict()
    c.envs.train = env_split(["SimpleSokoban"], [8], group_size=16, seed=10000)
    c.envs.val = env_split(["SimpleSokoban"], [256], group_size=1, seed=123)
    # Per-tag budgets (RAGEN envs.yaml: every shipped tag uses 100 prompt "max tokens").
    c.envs.max_actions_per_traj = ConfigDict(
        dict(
            SimpleSokoban=10,
            LargerSokoban=10,
            SokobanDifferentGridVocab=10,
            FrozenLake=10,
            Bandit=1,
            BanditTest=1,
        )
    )
    c.envs.prompt_max_tokens = 100  # only printed in the prompt: "Max response length: N words"
    # Extra constructor arguments per tag, e.g. {"Bandit": {"lo_arm_name": "Engineer"}}.
    c.envs.overrides = ConfigDict()
    # quirk 1: RAGEN's prompt legend shows the default symbols even for SokobanDifferentGridVocab.
    c.envs.legend_from_env_symbols = False

    c.rollout = ConfigDict(
        dict(
            max_turn=5,
            max_actions_per_turn=5,
            enable_think=True,
            format_penalty=-0.1,
            response_length=400,  # max new tokens per turn
            max_model_len=3600,  # tokens per trajectory (prompt + all turns)
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            val_temperature=0.5,
            use_sampler_logprobs=False,  # old log-probs recomputed by the training forward (RAGEN)
        )
    )
    c.reward = ConfigDict(
        dict(
            grouping="state",  # state | batch | inductive
            method="identity",  # identity | mean | mean_std | asym_clip
            use_turn_scores=False,
        )
    )
    c.filter = ConfigDict(
        dict(
            ratio=0.25,  # StarPO-S keeps the top 25 % of groups by in-group reward std
            type="std",  # std | std_rev | top_p_var
        )
    )
    c.algorithm = ConfigDict(
        dict(
            adv_estimator="gae",  # gae | grpo | bilevel_gae
            gamma=1.0,
            lam=1.0,
            high_level_gamma=0.95,
            grpo_norm_by_std=True,
            kl_in_reward=False,
            kl_in_reward_coef=0.0,
            kl_penalty="kl",  # kl | abs | mse | low_var_kl
        )
    )
    c.actor = ConfigDict(
        dict(
            lr=1e-6,
            weight_decay=0.01,
            betas=(0.9, 0.999),
            grad_clip=1.0,
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            clip_ratio_c=3.0,
            entropy_coeff=0.001,
            use_kl_loss=False,
            kl_loss_coef=0.0,
            kl_loss_type="kl",
            loss_agg_mode="seq-mean-token-mean",  # RAGEN's effective mode (micro-batch 1)
            ppo_mini_batch_size=32,
            micro_batch_size=4,
            ppo_epochs=1,
        )
    )
    c.critic = ConfigDict(
        dict(
            lr=1e-5,
            weight_decay=0.01,
            betas=(0.9, 0.999),
            grad_clip=1.0,
            cliprange_value=0.5,
            warmup_steps=0,
        )
    )
    # LoRA on every linear layer of actor and critic (spec §5); rank 0 = full fine-tuning. With
    # LoRA the learning rates are lora.actor_lr / lora.critic_lr instead of actor.lr / critic.lr.
    c.lora = ConfigDict(dict(rank=0, alpha=64, actor_lr=1e-5, critic_lr=1e-4))
    # Devices: a data × fsdp × model mesh (starpo_jax/sharding.py); one size may be -1 (the devices
    # the others leave). data splits rows; fsdp splits rows and stores weights, critic, reference
    # and Adam moments 1/fsdp per device; model splits attention heads, MLP and vocabulary.
    c.mesh = ConfigDict(dict(data=-1, fsdp=1, model=1))
    # Many hosts (starpo_jax/distributed.py): the coordinator's host:port, the number of processes and
    # this one's index. Unset (""/-1): detected from SLURM, Open MPI or a TPU pod, else one process.
    c.distributed = ConfigDict(dict(coordinator_address="", num_processes=-1, process_id=-1))
    c.trainer = ConfigDict(
        dict(
            total_steps=200,
            test_freq=10,
            val_before_train=True,
            save_freq=-1,
            seed=0,
            output_dir="runs/default",
            resume=False,
            # A fresh run refuses a folder that holds an earlier run; True deletes that run's files first.
            overwrite=False,
            log_trajectories=20,
            export_hf=True,  # save the final policy as a Hugging Face folder (hf_policy/)
        )
    )
    return c
