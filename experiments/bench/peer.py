"""The same Bandit learning in Hugging Face TRL (``GRPOTrainer``) and in starpo-jax, side by side.

    python -m experiments.bench.peer                                   # DEFAULT_CONFIG, its steps
    python -m experiments.bench.peer --steps 2 --val-levels 4          # a smoke run
    python -m experiments.bench.peer --config configs/quickstart.py --config.actor.lr=3e-6
    python -m experiments.bench.peer --keep-filter                     # StarPO-S's filter on the starpo-jax side

Both sides start from the config's model (``model.source``), exported once as a Hugging Face
folder with the project's exporter; both see the prompt text starpo-jax's rollout shows the model
(its first-turn token ids for both arm orders, decoded); both are scored by the env's payout rule
(``envs_jax/bandit.py``) on the answer the project's parser (``starpo_jax/rollout/parsing.py``) reads, with
``rollout.format_penalty`` when no arm is named. Every TRL setting is derived from the config in
one place (``trl_settings``), where each mapping and each difference left is written down.

starpo-jax runs first, through ``python -m experiments.run`` (the normal entry point), then TRL in
this process. ``--rounds R`` times the two sides R times, their order alternating (starpo-jax then
TRL, then TRL then starpo-jax: ABBA for 2), so that a change in the machine's load during the
benchmark falls on both sides alike; the report gives every round's step times and the ratio of
warm medians per round. Only the first round's checkpoints are scored. Both save checkpoints at the same steps; each is exported to (or saved as) a Hugging
Face folder and scored by the same evaluator (``experiments.evaluate.evaluate_tags``, on
``diagnostics.fixed_levels`` as a run's validation) on the same validation levels (``envs.val.tags``,
``--val-levels`` each, from ``envs.val.seed``, at ``rollout.val_temperature``).
Writes ``<out>/bench_peer.json`` (every number) and ``<out>/bench_peer.png`` (success against
training seconds).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from configs.base import saved_config
from envs_jax.bandit import Bandit
from experiments.bench import common
from experiments.evaluate import evaluate_tags
from starpo_jax.models.loading import save_model
from starpo_jax.rollout.multi_turn import first_prompts
from starpo_jax.rollout.parsing import parse_response_text
from starpo_jax.rollout.sampling import sampling_policy
from starpo_jax.runtime import allocator, checkpoint, sharding
from starpo_jax.runtime.caches import setup_compilation_cache
from starpo_jax.runtime.experiment import (
    ConfigError,
    check_config,
    device_mesh,
    load_policy,
    rollout_plan,
    tokenized_plan,
    train_settings,
)
from starpo_jax.train import init_train_state, policy_weights

ROOT = Path(__file__).resolve().parents[2]  # the repository: experiments.run runs from it
DEFAULT_CONFIG = "configs/learn_bandit.py"  # the learning preset
EVAL_BATCH = 64  # levels per compiled validation rollout (experiments.evaluate's --batch default)
NO_TRL = "bench_peer needs trl, which is not installed: pip install -e '.[peer]'"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.peer", description=__doc__.split("\n\n")[0],
        epilog="Any --config.KEY=VALUE is a config override, as for experiments.run; both sides get it.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"config file[:preset] (default {DEFAULT_CONFIG})")
    p.add_argument("--steps", type=int, default=None, help="training steps of each side (default: trainer.total_steps)")
    p.add_argument("--val-levels", type=int, default=16, help="validation levels per env tag (default 16)")
    p.add_argument("--points", type=int, default=3,
                   help="checkpoints scored per side besides step 0, evenly spaced, the last at the final step (<= 3)")
    p.add_argument("--keep-filter", action="store_true",
                   help="run starpo-jax with the config's filter.ratio (TRL has no counterpart); default: "
                        "filter.ratio=1.0, the same maths on both sides")
    p.add_argument("--rounds", type=int, default=1,
                   help="timing rounds of both sides, the order alternating each round (2: ABBA); default 1")
    p.add_argument("--out", default="bench_results/peer")
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith("--config.")]
    if bad:
        p.error(f"unrecognised arguments: {' '.join(bad)}")
    args.overrides = rest
    if args.val_levels < 1 or args.val_levels % min(args.val_levels, EVAL_BATCH):
        p.error(f"--val-levels must be positive and, above {EVAL_BATCH}, a multiple of {EVAL_BATCH}")
    if not 1 <= args.points <= 3:  # run.py keeps the last 3 orbax checkpoints
        p.error("--points must be 1, 2 or 3")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


SIDES = ("starpo_jax", "trl")


def round_order(rounds: int) -> list[tuple[str, str]]:
    """Which side runs first in each round: alternating, so that 2 rounds are A B B A."""
    return [SIDES if r % 2 == 0 else SIDES[::-1] for r in range(rounds)]


def round_folder(out: Path, r: int) -> Path:
    """Round ``r``'s outputs: the first round's directly in ``out`` (the scored one), later ones apart."""
    return out if r == 0 else out / f"round_{r}"


def timing_report(rounds: list[dict]) -> dict:
    """Each round's warm median per side and the ratio TRL / starpo-jax of the two, and over the
    rounds the median and range of that ratio."""
    rows = []
    for r in rounds:
        medians = {side: step_summary(r[side])["median_warm_step_s"] for side in SIDES}
        ratio = medians["trl"] / medians["starpo_jax"] if None not in medians.values() else None
        rows.append({"order": list(r["order"]), **{f"{side}_step_s": r[side] for side in SIDES},
                     **{f"{side}_median_warm_step_s": medians[side] for side in SIDES}, "trl_over_starpo": ratio})
    ratios = [row["trl_over_starpo"] for row in rows if row["trl_over_starpo"] is not None]
    return {"rounds": rows, "median_ratio": statistics.median(ratios) if ratios else None,
            "ratio_range": [min(ratios), max(ratios)] if ratios else None}


# ---- config ------------------------------------------------------------------------------------------


def save_every(steps: int, points: int) -> int:
    return max(1, math.ceil(steps / points))


def bench_overrides(config, args, out: Path) -> list[str]:
    """What bench_peer sets on top of the user's config, as overrides (applied to both sides)."""
    steps = args.steps or int(config.trainer.total_steps)
    sets = {
        "trainer.total_steps": steps,
        "trainer.save_freq": save_every(steps, args.points),
        "trainer.save_every_minutes": 0,  # the points above are the last 3 checkpoints kept: no others
        "trainer.test_freq": 0,  # no in-run validation: both sides are scored afterwards, alike
        "trainer.output_dir": str(out / "starpo"),
        "trainer.overwrite": True,
        "trainer.resume": False,
        "trainer.export_hf": True,
    }
    if not args.keep_filter:
        sets["filter.ratio"] = 1.0
    return [f"--config.{k}={v}" for k, v in sets.items()]


def iteration_batch(config) -> int:
    return int(sum(config.envs.train.n_groups)) * int(config.envs.train.group_size)


def trl_settings(config) -> tuple[dict, list[str]]:
    """``GRPOConfig`` keyword arguments equal to the config's StarPO maths, and the differences left.

    One line per setting. Raises ``ConfigError`` where TRL has no counterpart.
    """
    r, a, alg, rw = config.rollout, config.actor, config.algorithm, config.reward
    batch, group = iteration_batch(config), int(config.envs.train.group_size)
    mini, micro = int(a.ppo_mini_batch_size), int(a.micro_batch_size)

    def need(ok: bool, what: str):
        if not ok:
            raise ConfigError(f"bench_peer: {what} has no TRL GRPOTrainer counterpart.")

    need(alg.adv_estimator == "grpo", f"algorithm.adv_estimator={alg.adv_estimator!r} (a critic)")
    need(rw.method in ("identity", "mean", "mean_std"), f"reward.method={rw.method!r}")
    need(rw.method == "identity" or rw.grouping == "state", f"reward.grouping={rw.grouping!r} with reward.method={rw.method!r}")
    need(not rw.use_turn_scores, "reward.use_turn_scores=True")
    need(not alg.kl_in_reward, "algorithm.kl_in_reward=True (KL in the reward)")
    need(not a.use_kl_loss or a.kl_loss_type in ("low_var_kl", "k3"),
         f"actor.use_kl_loss with actor.kl_loss_type={a.kl_loss_type!r} (TRL's KL is k3)")
    one_step = int(a.ppo_epochs) == 1 and mini == batch  # one optimizer step per rollout: its ratio is 1 on both sides
    need(not r.use_sampler_logprobs or one_step,
         "rollout.use_sampler_logprobs=True with more than one optimizer step per rollout (TRL has it only with vLLM)")
    need(int(config.rollout.max_turn) == 1, "rollout.max_turn > 1 (GRPOTrainer is single-turn)")
    need(int(config.lora.rank) == 0, "lora.rank > 0 (bench_peer compares full fine-tuning)")
    need(batch % mini == 0 and mini % micro == 0,
         f"a training batch of {batch} in mini-batches of {mini} and micro-batches of {micro}")
    need(a.loss_agg_mode in LOSS_TYPES, f"actor.loss_agg_mode={a.loss_agg_mode!r}")
    kwargs = dict(
        num_generations=group,                                   # envs.train.group_size
        per_device_train_batch_size=micro,                       # actor.micro_batch_size
        gradient_accumulation_steps=mini // micro,               # actor.ppo_mini_batch_size / micro
        steps_per_generation=batch // micro,                     # one rollout of n_groups x group_size
        num_iterations=int(a.ppo_epochs),                        # actor.ppo_epochs
        learning_rate=float(a.lr),                               # actor.lr
        adam_beta1=float(a.betas[0]), adam_beta2=float(a.betas[1]),  # actor.betas
        adam_epsilon=1e-8,                                       # optax.scale_by_adam's eps
        weight_decay=float(a.weight_decay),                      # actor.weight_decay (on every weight: see run_trl)
        max_grad_norm=float(a.grad_clip),                        # actor.grad_clip
        lr_scheduler_type="constant", warmup_steps=0,            # starpo-jax: constant lr (TRL default: linear decay)
        max_completion_length=int(r.response_length),            # rollout.response_length
        temperature=float(r.temperature),                        # rollout.temperature (sampling and log-probs)
        top_p=float(r.top_p),                                    # rollout.top_p
        top_k=max(int(r.top_k), 0),                              # rollout.top_k (<= 0: off, TRL 0)
        min_p=None, repetition_penalty=1.0,
        epsilon=float(a.clip_ratio_low),                         # actor.clip_ratio_low
        epsilon_high=float(a.clip_ratio_high),                   # actor.clip_ratio_high
        beta=float(a.kl_loss_coef) if a.use_kl_loss else 0.0,    # actor.use_kl_loss / kl_loss_coef
        loss_type=LOSS_TYPES[a.loss_agg_mode],                   # actor.loss_agg_mode
        scale_rewards="group" if alg.grpo_norm_by_std else "none",  # algorithm.grpo_norm_by_std
        entropy_coef=float(a.entropy_coeff),                     # actor.entropy_coeff
        mask_truncated_completions=False,                        # starpo-jax trains cut responses too
        importance_sampling_level="token",
        gradient_checkpointing=config.model.remat != "none",   # model.remat: layers recomputed in the backward
        seed=int(config.trainer.seed),
    )
    notes = [
        f"loss aggregation: actor.loss_agg_mode={a.loss_agg_mode} -> loss_type={kwargs['loss_type']!r}",
        "KL: " + ("none (beta=0)" if not kwargs["beta"] else f"k3 KL loss, beta={kwargs['beta']}"),
        f"clipping: clip_ratio_low/high {a.clip_ratio_low}/{a.clip_ratio_high} -> epsilon/epsilon_high; "
        f"starpo-jax's dual-clip (actor.clip_ratio_c={a.clip_ratio_c}) has no TRL counterpart; it acts only on "
        "negative advantages with ratio > clip_ratio_c, i.e. never while one mini-batch per rollout keeps the ratio 1",
        f"reward scaling: reward.method={rw.method}, algorithm.grpo_norm_by_std={alg.grpo_norm_by_std} -> "
        f"scale_rewards={kwargs['scale_rewards']!r}; group mean and unbiased std on both sides, but the std epsilon is "
        "1e-6 in starpo-jax and 1e-4 in TRL (a relative difference below 1e-3 for Bandit rewards)",
        f"one update pass per rollout: ppo_epochs={a.ppo_epochs} -> num_iterations; {batch // mini} optimizer step(s) "
        "per rollout -> steps_per_generation / gradient_accumulation_steps",
        ("old log-probs: the sampler's (rollout.use_sampler_logprobs=True), and TRL, with one optimizer step per "
         "rollout, takes the current log-probs detached: the ratio of that one step is 1 on both sides (in starpo-jax "
         "up to the rounding between sampler and trainer), so the same maths"
         if r.use_sampler_logprobs else
         "old log-probs: recomputed by the training model on both sides (rollout.use_sampler_logprobs=False); with one "
         "optimizer step per rollout TRL takes them as the current log-probs detached (ratio exactly 1)"),
        f"entropy bonus: actor.entropy_coeff={a.entropy_coeff} -> entropy_coef; TRL averages the entropy over the "
        "micro-batch's tokens (token-mean), starpo-jax with actor.loss_agg_mode",
        "optimizer: AdamW on every weight in both (TRL is handed a torch.optim.AdamW over all parameters; HF Trainer's "
        "own would exempt biases and norms from weight decay), constant learning rate, grad clip by global norm",
        f"memory: model.remat={config.model.remat!r} -> gradient_checkpointing={kwargs['gradient_checkpointing']} "
        "(TRL recomputes each decoder layer; starpo-jax's 'dots' also keeps the projections)",
        "sampling: the same stop tokens (chat end-of-turn and EOS); responses cut at max_completion_length are trained "
        "on both sides",
    ]
    return kwargs, notes


# starpo-jax actor.loss_agg_mode -> TRL loss_type (seq-mean-token-sum has none).
LOSS_TYPES = {
    "seq-mean-token-mean": "grpo",       # mean over sequences of each one's token mean
    "token-mean": "dapo",                # tokens of the whole mini-batch (TRL: the accumulated batch)
    "seq-mean-token-sum-norm": "dr_grpo",  # token sum / (sequences x max length)
}


def filter_note(config, keep_filter: bool) -> str:
    ratio = float(config.filter.ratio)
    if not keep_filter:
        return ("starpo-jax ran with filter.ratio=1.0 (every group trained), the same maths as TRL; "
                "--keep-filter runs it with the config's StarPO-S filter")
    return (f"starpo-jax ran with StarPO-S's filter as configured (filter.ratio={ratio}, {config.filter.type}): "
            "it trains on the groups whose rewards vary most; TRL has no such filter and trains on every group")


# ---- prompts and reward ----------------------------------------------------------------------------


def bandit_prompts(config, tokenizer) -> dict[bool, str]:
    """``{hi_first: prompt text}``: starpo-jax's first-turn prompt tokens, from the rollout's
    tables and its ``first_prompts``, for both arm orders, decoded as they are."""
    plan = rollout_plan(config, "train")
    tag = _bandit_tag(plan)
    plan, tables = tokenized_plan(config, "train", dataclasses.replace(plan, tags=(tag,)), tokenizer, None)
    states = tag.env.reset_from_seed(0)
    states = type(states)(hi_first=jnp.asarray([False, True]), key=jnp.stack([states.key, states.key]))
    ids, lengths = first_prompts(plan, tables, (states,))
    return {hi: tokenizer.decode([int(t) for t in ids[i, : int(lengths[i])]], skip_special_tokens=False,
                                 clean_up_tokenization_spaces=False)
            for i, hi in enumerate((False, True))}


def _bandit_tag(plan):
    if len(plan.tags) != 1 or not isinstance(plan.tags[0].env, Bandit):
        raise ConfigError(f"bench_peer trains one Bandit tag; envs.train.tags is {tuple(t.name for t in plan.tags)}.")
    return plan.tags[0]


def score_completion(text: str, hi_first: bool, env, plan, u: float) -> tuple[float, bool]:
    """(reward, success) of one decoded completion, as starpo-jax's rollout scores it.

    The project's parser reads the answer (arm names in action-id order, i.e. the prompt's order);
    the first executed action pulls an arm (a Bandit episode ends with it) and earns the env's
    ``payout`` for the uniform draw ``u``; an answer that is no arm (or names an unknown one) adds
    ``rollout.format_penalty``.
    """
    lo, hi = env.lo_hi_names
    names = (hi, lo) if hi_first else (lo, hi)
    parsed = parse_response_text(text, names, plan.max_actions_per_turn, plan.enable_think)
    ids = parsed.valid_action_ids
    reward, success = 0.0, False
    if ids:
        success = (ids[0] == 0) == hi_first
        reward = float(env.payout(success, u))
    if parsed.format_error:
        reward += float(plan.format_penalty)
    return reward, success


class BanditReward(Protocol):
    """``reward_function``'s answer: a plain function, as TRL wants (it names a reward by its
    ``__name__``), that keeps every completion's success and reward, in the order scored."""

    __name__: str
    successes: list[bool]
    rewards: list[float]

    def __call__(self, completions, hi_first, **_) -> list[float | None]: ...  # TRL's type: None is no reward


def reward_function(config, seed: int) -> BanditReward:
    """TRL reward function: the env rule on each completion; its draws from ``seed``."""
    plan = rollout_plan(config, "train")
    env = _bandit_tag(plan).env
    rng = np.random.default_rng(seed)
    successes: list[bool] = []
    rewards: list[float] = []

    def bandit_reward(completions, hi_first, **_) -> list[float]:
        out: list[float] = []
        for text, h in zip(completions, hi_first):
            reward, success = score_completion(text, bool(h), env, plan, float(rng.random()))
            out.append(reward)
            successes.append(success)
        rewards.extend(out)
        return out

    reward = cast(BanditReward, bandit_reward)  # the function, given the two lists below
    reward.successes, reward.rewards = successes, rewards  # every completion scored, in order
    return reward


# ---- the two sides -----------------------------------------------------------------------------------


def export_base(config, folder: Path):
    """(folder, tokenizer): the config's starting model as a Hugging Face folder (the project's
    exporter) and its tokenizer."""
    model, tokenizer = load_policy(config)
    return save_model(model.merge(), tokenizer, folder), tokenizer


def run_starpo(config_path: str, overrides: list[str], log) -> None:
    cmd = [sys.executable, "-m", "experiments.run", "--config", config_path, *overrides]
    log("starpo-jax: " + " ".join(cmd[1:]))
    subprocess.run(cmd, check=True, cwd=ROOT)


def starpo_steps(run_dir: Path, tag: str) -> dict:
    """Per training step of the run's ``metrics.jsonl``: seconds, train success and reward mean."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in sorted(lines, key=lambda m: m["step"]) if "timing_s/step" in m]
    return {"step_s": [m["timing_s/step"] for m in steps],
            "train_success": [m[f"train/{tag}/success"] for m in steps],
            "train_reward": [m["train/reward/mean"] for m in steps]}


def per_step_means(values: list, batch: int) -> list[float]:
    return [float(sum(values[i: i + batch]) / len(values[i: i + batch])) for i in range(0, len(values), batch)]


def export_starpo_checkpoints(run_dir: Path) -> dict[int, Path]:
    """{step: HF folder} for every checkpoint run.py kept (the final one is its ``hf_policy/``)."""
    config = saved_config(run_dir / "config.json")
    steps = checkpoint.saved_steps(run_dir / "checkpoints")
    folders = {}
    model = tokenizer = None
    for step in steps:
        if step == config.trainer.total_steps and (run_dir / "hf_policy").is_dir():
            folders[step] = run_dir / "hf_policy"
            continue
        if model is None:
            model, tokenizer = load_policy(config)
            settings = train_settings(config, rollout_plan(config, "train"))
            like = init_train_state(settings, model, jax.random.PRNGKey(0))
        state = checkpoint.restore(checkpoint.manager(run_dir / "checkpoints"), like, step=step).state
        policy = dataclasses.replace(model, params=policy_weights(settings, state))
        folders[step] = save_model(policy.merge(), tokenizer, run_dir / f"hf_step_{step}")
    return folders


class _StepTimer:
    """A TrainerCallback timing each optimizer step (generation, scoring and update; no saving)."""

    def __init__(self):
        from transformers import TrainerCallback  # the TRL side's, imported with it

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer.seconds.append(time.perf_counter() - timer.t0)

        self.t0: float  # perf_counter() as the current step began (set then)
        self.seconds: list[float] = []
        self.callback = Callback()


def run_trl(config, base: Path, prompts: dict[bool, str], steps: int, out: Path, log) -> dict:
    """Train with TRL's GRPOTrainer; returns step times and {step: checkpoint folder}."""
    import torch  # these four, the peer extra, are imported where they are used: not in the default install
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    kwargs, _ = trl_settings(config)
    per_iteration = iteration_batch(config) // int(config.actor.ppo_mini_batch_size) * kwargs["num_iterations"]
    every = int(config.trainer.save_freq)
    torch.manual_seed(kwargs["seed"])
    bf16 = config.model.dtype == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    plan = rollout_plan(config, "train")
    first_tag = dataclasses.replace(plan, tags=plan.tags[:1])
    stops = tokenized_plan(config, "train", first_tag, tokenizer, None)[0].stop_tokens
    # Fresh levels every step, as starpo-jax draws them: a fair coin for the arm order per group.
    rng = np.random.default_rng(kwargs["seed"])
    n_groups = int(sum(config.envs.train.n_groups))
    order = [bool(h) for h in rng.random(steps * n_groups) < 0.5]
    dataset = Dataset.from_dict({"prompt": [prompts[h] for h in order], "hi_first": order})
    args = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=steps * per_iteration, save_strategy="steps",
        save_steps=every * per_iteration, save_only_model=True, logging_steps=1, report_to="none",
        use_cpu=not torch.cuda.is_available(), bf16=bf16, dataloader_num_workers=0,
        generation_kwargs={"eos_token_id": list(stops)},  # starpo-jax's stop tokens
        **kwargs,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=kwargs["learning_rate"],
                                  betas=(kwargs["adam_beta1"], kwargs["adam_beta2"]), eps=kwargs["adam_epsilon"],
                                  weight_decay=kwargs["weight_decay"])
    timer = _StepTimer()
    reward = reward_function(config, kwargs["seed"] + 1)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer.callback], optimizers=(optimizer, None))
    log(f"TRL: {steps * per_iteration} optimizer steps, {per_iteration} per rollout of {iteration_batch(config)}")
    trainer.train()
    final = out / "trl" / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(str(final))
    seconds = [sum(timer.seconds[i: i + per_iteration]) for i in range(0, len(timer.seconds), per_iteration)]
    folders = {}
    for step in range(every, steps + 1, every):
        folder = out / "trl" / f"checkpoint-{step * per_iteration}"
        if folder.is_dir():
            folders[step] = folder
    folders[steps] = final
    batch = iteration_batch(config)  # the reward function scores each rollout once
    return {"step_s": seconds, "folders": folders, "train_success": per_step_means(reward.successes, batch),
            "train_reward": per_step_means(reward.rewards, batch)}


# ---- evaluation -------------------------------------------------------------------------------------


def evaluate_folder(config, folder: Path, levels: int) -> dict:
    """``experiments.evaluate``'s evaluator on one HF folder, with the config's validation tags,
    levels (``envs.val.seed``), prompt and sampling settings (``rollout.val_temperature``): the
    same for every policy scored."""
    config = copy.deepcopy(config)
    config.model.source, config.model.random_init_preset = str(folder), ""
    model, tokenizer = load_policy(config)
    batch = min(levels, EVAL_BATCH)
    mesh = device_mesh(config, **{"--val-levels": batch})
    with sharding.use_mesh(mesh):
        policy = sharding.shard(sampling_policy(model.graphdef, model.params), mesh)
        results = evaluate_tags(config, tuple(config.envs.val.tags), policy, tokenizer, levels, batch)
    return {tag: r["success"] for tag, r in results.items()}


def step_summary(seconds: list[float]) -> dict:
    warm = seconds[1:]
    return {
        "first_step_s": seconds[0] if seconds else None,  # compilation (starpo-jax) / warm-up included
        "median_warm_step_s": statistics.median(warm) if warm else None,
        "warm_steps": len(warm),
        "step_s": seconds,
    }


def side_report(label: str, run: dict, scored: dict, folders: dict) -> dict:
    return {"label": label, **step_summary(run["step_s"]), "wall_s": run["wall_s"],
            "train_success": run["train_success"], "train_reward": run["train_reward"],
            "curve": curve(run["step_s"], scored), "folders": {s: str(f) for s, f in folders.items()}}


def curve(seconds: list[float], successes: dict[int, dict]) -> list[dict]:
    """Success at each scored step against the training seconds spent to reach it."""
    rows = []
    for step in sorted(successes):
        rows.append({"step": step, "train_s": sum(seconds[:step]), "success": successes[step],
                     "mean_success": statistics.fmean(successes[step].values())})
    return rows


def write_chart(report: dict, path: Path) -> None:
    import matplotlib  # here: seconds to import, and the backend is chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for side, style in (("starpo_jax", "o-"), ("trl", "s--")):
        rows = report[side]["curve"]
        ax.plot([r["train_s"] for r in rows], [100 * r["mean_success"] for r in rows], style, label=report[side]["label"])
        for r in rows:
            ax.annotate(str(r["step"]), (r["train_s"], 100 * r["mean_success"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("training seconds (sum of step times, first step included)")
    ax.set_ylabel(f"validation success, % (mean of {', '.join(report['val_tags'])})")
    ax.set_title(f"Bandit, {report['model']}: starpo-jax vs TRL GRPOTrainer ({report['steps']} steps)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        print(f"error: {NO_TRL}", file=sys.stderr)
        return 2

    log = tqdm.write
    out = Path(args.out)
    try:
        user = common.load_config(args.config, args.overrides)
        overrides = [*args.overrides, *bench_overrides(user, args, out)]
        config = common.load_config(args.config, overrides)
        check_config(config)
        _, notes = trl_settings(config)
        _bandit_tag(check_config(config).train_plan)
    except (ConfigError, ValueError, KeyError, AttributeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    setup_compilation_cache()  # the checkpoints' evaluations reuse one compilation
    steps = int(config.trainer.total_steps)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    base, tokenizer = export_base(config, out / "base_hf")
    prompts = bandit_prompts(config, tokenizer)

    tag = _bandit_tag(check_config(config).train_plan).name
    runs: list[dict] = []
    for r, order in enumerate(round_order(args.rounds)):
        folder = round_folder(out, r)
        done: dict = {"order": order}
        for side in order:
            t0 = time.perf_counter()
            if side == "starpo_jax":
                run_starpo(args.config, [*overrides, f"--config.trainer.output_dir={folder / 'starpo'}"], log)
                done[side] = {**starpo_steps(folder / "starpo", tag), "wall_s": time.perf_counter() - t0}
            else:
                done[side] = {**run_trl(config, base, prompts, steps, folder, log), "wall_s": time.perf_counter() - t0}
        runs.append(done)
    # wall_s: starpo-jax's process (start, model load, steps, saves, export); TRL's model load, set-up, steps, saves
    starpo_run, trl_run = runs[0]["starpo_jax"], runs[0]["trl"]
    starpo_folders = export_starpo_checkpoints(out / "starpo")

    jobs = [("base", 0, base)] + [("starpo_jax", s, f) for s, f in sorted(starpo_folders.items())] \
        + [("trl", s, f) for s, f in sorted(trl_run["folders"].items())]
    scored: dict[str, dict[int, dict]] = {"starpo_jax": {}, "trl": {}}
    for side, step, folder in tqdm(jobs, desc="score checkpoints", unit="policy"):
        success = evaluate_folder(config, folder, args.val_levels)
        for s in ([side] if side != "base" else list(scored)):
            scored[s][step] = success
    trl_kwargs, _ = trl_settings(config)
    import trl as trl_module  # the peer extra (checked above)

    report = {
        "benchmark": "bench_peer",
        "config": args.config,
        "overrides": overrides,
        "model": config.model.source,
        "steps": steps,
        "batch": {"groups": int(sum(config.envs.train.n_groups)), "group_size": int(config.envs.train.group_size)},
        "val_tags": list(config.envs.val.tags),
        "val_levels": args.val_levels,
        "filter": {"keep_filter": args.keep_filter, "filter.ratio": float(config.filter.ratio),
                   "note": filter_note(config, args.keep_filter)},
        "prompts": {"hi_first": prompts[True], "lo_first": prompts[False]},
        "trl_settings": trl_kwargs,
        "mapping_notes": notes,
        "versions": {"trl": trl_module.__version__, "jax": jax.__version__},
        "starpo_jax": side_report("starpo-jax", starpo_run, scored["starpo_jax"], starpo_folders),
        "trl": side_report(f"TRL {trl_module.__version__} GRPOTrainer", trl_run, scored["trl"], trl_run["folders"]),
        "timing": timing_report([{"order": r["order"], **{side: r[side]["step_s"] for side in SIDES}} for r in runs]),
        "wall_s": time.perf_counter() - t_start,
        "machine": common.machine(),
    }
    path = out / "bench_peer.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    write_chart(report, path.with_suffix(".png"))
    for side in ("starpo_jax", "trl"):
        r = report[side]
        last = r["curve"][-1]
        log(f"{r['label']:28s} first step {r['first_step_s']:.1f}s, warm median "
            f"{r['median_warm_step_s'] if r['median_warm_step_s'] is None else round(r['median_warm_step_s'], 2)}s, "
            f"success after {last['step']} steps {100 * last['mean_success']:.1f}%")
    timing = report["timing"]
    if len(timing["rounds"]) > 1 and timing["median_ratio"] is not None:
        low, high = timing["ratio_range"]
        log(f"TRL / starpo-jax per warm step over {len(timing['rounds'])} alternating rounds: median "
            f"{timing['median_ratio']:.2f}x (rounds {low:.2f}-{high:.2f}x)")
    log(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    allocator.restart_with_tcmalloc()  # first, before XLA starts: the process is replaced
    sys.exit(main())
