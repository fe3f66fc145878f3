"""Named presets for the paper's runs (RAGEN's ``train_all.sh``; ragen-reference.md §3.8, §6).

``get_config(name)`` starts from ``configs/base.py`` (StarPO-S on SimpleSokoban) and applies the
preset's overrides. Presets compose with ``+``, applied left to right (later wins); put the env
first::

    python -m experiments.run --config configs/presets.py:starpo_grpo
    python -m experiments.run --config configs/presets.py:frozen_lake+base_ppo_nokl
    python -m experiments.run --config configs/presets.py:sokoban_generalisation+qwen2.5_1.5b_instruct

Each preset is data: a dict {"section.key": value} (``base.with_overrides`` rejects unknown keys).
docs/configs.md lists which figure or table each reproduces.

Decisions on the original's quirks (docs/design.md's quirks table):

- Quirk 10 (fixed): RAGEN's vanilla PPO sets KL coefficients of 0.001 but enables neither KL
  path, so no KL acts and its "No KL" ablation equals "Base PPO". Our KL-in-reward really acts,
  and ``starpo_ppo`` uses it as the paper describes (k1 estimate, coefficient 0.001, no KL loss
  term). RAGEN's code-level vanilla PPO is therefore ``base_ppo_nokl``. ``starpo_grpo`` uses the
  KL loss (k1, 0.001), as RAGEN's GRPO recipe does, and no KL in the reward.
- Quirk 8: RAGEN's GRPO is ``reward.method=mean_std`` (grouped by initial state) with veRL's GRPO
  seeing singleton groups. Our ``grpo`` groups for real; normalising already-normalised scores
  again changes them by at most the 1e-6 epsilon, so the recipe is kept as written.
- Online-10 (ragen-reference.md §3.8): ``train_all.sh`` runs 80 steps where its pattern (200 optimizer steps and
  20 validations per run: 2×100, 5×40) gives 20; we use 20 (``--config.trainer.total_steps=80``
  replays the script).
- The Sokoban generalisation suite validates on 128 levels per env as ``train_all.sh`` does; the
  paper's percentages are multiples of 1/256 (``--config.envs.val.n_groups="(256,256,256,256)"``).
"""

from configs import bandit, base, frozen_lake, sokoban

# ---- building blocks ---------------------------------------------------------------------------

# train_all.sh USE_BASE: vanilla StarPO (no filtering, symmetric clipping, KL 0.001).
VANILLA = {
    "filter.ratio": 1.0,
    "actor.clip_ratio_high": 0.2,
    "actor.kl_loss_coef": 0.001,
    "algorithm.kl_in_reward_coef": 0.001,
}
# RAGEN's GRPO recipe: group-normalised scores, no critic.
GRPO = {"algorithm.adv_estimator": "grpo", "reward.method": "mean_std"}
NO_KL = {
    "actor.use_kl_loss": False,
    "actor.kl_loss_coef": 0.0,
    "algorithm.kl_in_reward": False,
    "algorithm.kl_in_reward_coef": 0.0,
}
NOTHINK = {"rollout.enable_think": False}

STARPO_PPO = {**VANILLA, "algorithm.kl_in_reward": True}
STARPO_GRPO = {**VANILLA, **GRPO, "actor.use_kl_loss": True}

# SOKOBAN_GENERALIZATION_CONFIG: validate a Sokoban-trained policy on four envs.
GENERALISATION_TAGS = ("SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab", "FrozenLake")
GENERALISATION_VAL = {
    "envs.val.tags": GENERALISATION_TAGS,
    "envs.val.n_groups": (128,) * len(GENERALISATION_TAGS),
    "envs.val.group_size": 1,
}


def _bandit_arms(train_lo: str, train_hi: str, test_lo: str, test_hi: str) -> dict:
    """Section 5.1 of train_all.sh: renamed arms for training (Bandit) and testing (BanditTest)."""
    return {
        **bandit.CHANGES,
        "envs.overrides.Bandit.lo_arm_name": train_lo,
        "envs.overrides.Bandit.hi_arm_name": train_hi,
        "envs.overrides.BanditTest.lo_arm_name": test_lo,
        "envs.overrides.BanditTest.hi_arm_name": test_hi,
    }


BANDIT_NORMAL = _bandit_arms("Engineer", "Teacher", "Trader", "Librarian")
BANDIT_REV = _bandit_arms("Teacher", "Engineer", "Librarian", "Trader")

# (env_groups, steps, test_freq) for Online-k: k = optimizer steps per rollout with filter 0.25
# (8k groups x 16 kept at 25 % = 32k trajectories = k mini-batches of 32).
ONLINE = {2: (16, 100, 5), 5: (40, 40, 2), 10: (80, 20, 1)}

MODELS = {
    "qwen2.5_0.5b_instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5_1.5b_instruct": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2.5_3b_instruct": "Qwen/Qwen2.5-3B-Instruct",
    "qwen2.5_7b_instruct": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2.5_0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5_1.5b": "Qwen/Qwen2.5-1.5B",
    "qwen2.5_3b": "Qwen/Qwen2.5-3B",
    "qwen2.5_7b": "Qwen/Qwen2.5-7B",
    "r1_distill_qwen_1.5b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    "r1_distill_qwen_7b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
}

# ---- the presets -------------------------------------------------------------------------------

PRESETS: dict[str, dict] = {
    # Environments (ragen-reference.md §1.5), the same as the env config files.
    "sokoban": sokoban.CHANGES,
    "frozen_lake": frozen_lake.CHANGES,
    "bandit": bandit.CHANGES,
    # Algorithms (Figs. 5 and 9).
    "starpo_s": {},
    "starpo_ppo": STARPO_PPO,
    "starpo_grpo": STARPO_GRPO,
    "starpo_s_grpo": GRPO,
    "nothink": NOTHINK,
    # App. D / config/base-lora.yaml: LoRA rank 64, alpha 64 on all linear layers (lr 1e-5 / 1e-4).
    "lora": {"lora.rank": 64, "lora.alpha": 64},
    # Fig. 7: keep the top r of groups by reward std, on StarPO-S (PPO) and StarPO-S with GRPO.
    **{f"filter_{r}": {"filter.ratio": r} for r in (0.25, 0.5, 0.75, 1.0)},
    **{f"grpo_filter_{r}": {**GRPO, "filter.ratio": r} for r in (0.25, 0.5, 0.75, 1.0)},
    # Fig. 8: vanilla PPO plus clip-higher, or minus KL (base-grpo and base-ppo are starpo_grpo
    # and starpo_ppo).
    "base_ppo_cliphigh": {**STARPO_PPO, "actor.clip_ratio_high": 0.28},
    "base_ppo_nokl": {**STARPO_PPO, **NO_KL},
    # Table 2: prompts x responses per prompt at a fixed batch of 128.
    **{
        f"diversity_{groups}x{size}": {
            **GENERALISATION_VAL,
            "envs.train.n_groups": (groups,),
            "envs.train.group_size": size,
        }
        for groups, size in ((4, 32), (8, 16), (16, 8), (32, 4), (64, 2), (128, 1))
    },
    # Table 3 (train_all.sh runs k = 1..8; the paper reports 1..7): k actions per turn, 5k per
    # episode for every env of the run.
    **{
        f"actions_per_turn_{k}": {
            **GENERALISATION_VAL,
            "rollout.max_actions_per_turn": k,
            **{f"envs.max_actions_per_traj.{tag}": 5 * k for tag in GENERALISATION_TAGS},
        }
        for k in range(1, 9)
    },
    # Table 4 and Fig. 11: reasoning vs no reasoning, Sokoban trained, four envs validated.
    "sokoban_generalisation": GENERALISATION_VAL,
    "sokoban_generalisation_nothink": {**GENERALISATION_VAL, **NOTHINK},
    # Fig. 10: k optimizer steps per rollout batch (Online-1 is sokoban_generalisation).
    **{
        f"online_{k}": {
            **GENERALISATION_VAL,
            "envs.train.n_groups": (groups,),
            "trainer.total_steps": steps,
            "trainer.test_freq": test_freq,
        }
        for k, (groups, steps, test_freq) in ONLINE.items()
    },
    # Table 4 and Fig. 11: Bandit reasoning generalisation (train arms -> test arms). The paper's
    # text describes "rev" the other way round (ragen-reference.md §1.2); these are the script's names.
    "bandit_normal": BANDIT_NORMAL,
    "bandit_normal_nothink": {**BANDIT_NORMAL, **NOTHINK},
    "bandit_rev": BANDIT_REV,
    "bandit_rev_nothink": {**BANDIT_REV, **NOTHINK},
    # Model-size runs (section 5.2 of train_all.sh): only the checkpoint changes.
    **{name: {"model.source": source} for name, source in MODELS.items()},
    # Past one device (docs/scaling.md): every device holds 1/N of the weights, critic, reference and
    # Adam moments (FSDP), rows split N ways, one row per device per micro-batch on 8 devices. E.g.
    # starpo_ppo+qwen2.5_7b_instruct+fsdp_8 is 7B full fine-tuning with critic and reference on 8 GPUs.
    "fsdp_8": {"mesh.data": 1, "mesh.fsdp": -1, "mesh.model": 1, "actor.micro_batch_size": 8},
}


def get_config(name: str = "starpo_s"):
    """The config of preset ``name``, or of several joined by ``+`` (applied left to right)."""
    config = base.get_config()
    for part in name.split("+"):
        if part not in PRESETS:
            raise ValueError(
                f"Unknown preset {part!r}. Known presets (join several with '+'): {', '.join(PRESETS)}."
            )
        config = base.with_overrides(config, PRESETS[part])
    config.trainer.output_dir = f"runs/{name}"
    return config
