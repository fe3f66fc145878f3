"""Evaluate a policy on a validation suite: the config's fixed levels and temperature (RAGEN's seeds 123 upward, 0.5).

    python -m experiments.evaluate --model smollm2-135m-instruct --suite bandit
    python -m experiments.evaluate --model runs/sokoban --suite sokoban_generalisation --levels 256
    python -m experiments.evaluate --model Qwen/Qwen2.5-0.5B-Instruct --suite sokoban
    python -m experiments.evaluate --model smollm2-135m-instruct --suite bandit --no-think
    python -m experiments.evaluate --model smollm2-135m-instruct --suite countdown --max-turn 1
    python -m experiments.evaluate --model runs/learn_frozen_lake --suite frozen_lake --levels 64 --policy random-valid

``--model`` is anything ``load_model`` takes (the bundled name, a GGUF file, a Hugging Face folder
or hub id) or a training run folder (its config and latest checkpoint). Prints a success table per
env, in the shape of the paper's Tables 2-4, and writes JSON: ``--out``, by default
``<run folder>/evaluate_<suite>_<levels>levels.json`` beside an evaluated run, else
``bench_results/evaluate_<model>_<suite>_<levels>levels.json``; replacing an earlier file is
announced once the inputs are checked. Success rates come with their 95 % Wilson intervals.
``--policy random-valid`` plays the same levels with uniformly random valid answers instead of the
model (``format_warmup.RandomAnswers``): what a policy blind to the board scores by chance, under
the same rollout settings (``--model`` then supplies the config and tokenizer).
The levels are played as the run's validation plays them (``diagnostics.fixed_levels``): from
``envs.val.seed`` on, continuing across the suite's envs, at ``rollout.val_temperature`` (the run
folder's, else the defaults; ``--seed`` and ``--temperature`` set them), ``--batch`` levels a call.
On a CPU each level is a full multi-turn rollout: 256 levels per env (the paper's, the default)
take minutes per env; ``--levels 16`` gives a first look.
"""

from __future__ import annotations

from experiments import bootstrap

if __name__ == "__main__":  # first: restarts on tcmalloc before the imports below
    bootstrap.command("experiments.evaluate", bootstrap.run_nothing_first, entry="main")

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import jax
from tqdm import tqdm

import envs_jax
from configs import base
from experiments.curves import wilson
from starpo_jax.diagnostics import fixed_levels
from starpo_jax.format_warmup import RandomAnswers, answer_pieces, check_named_actions
from starpo_jax.models.loading import ModelLoadError
from starpo_jax.rollout.multi_turn import chunk_plan
from starpo_jax.rollout.sampling import sampling_policy
from starpo_jax.runtime import checkpoint, sharding
from starpo_jax.runtime.caches import setup_compilation_cache
from starpo_jax.runtime.checkpoint import CheckpointError
from starpo_jax.runtime.experiment import (
    ConfigError,
    device_mesh,
    load_policy,
    model_compute,
    rollout_plan,
    tokenized_plan,
    train_settings,
)
from starpo_jax.runtime.settings import check_settings
from starpo_jax.train import init_train_state, policy_weights

SUITES = {
    "sokoban": ("SimpleSokoban",),
    "frozen_lake": ("FrozenLake",),
    "bandit": ("Bandit", "BanditTest"),
    "countdown": ("Countdown",),
    "sokoban_generalisation": ("SimpleSokoban", "SokobanDifferentGridVocab", "LargerSokoban", "FrozenLake"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.evaluate",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="bundled name, .gguf, HF folder, hub id, or a run folder")
    p.add_argument("--suite", default="sokoban", help=f"one of {', '.join(SUITES)}, or an env name")
    p.add_argument("--levels", type=int, default=256,
                   help="levels per env (RAGEN's seeds 123..; the paper used 256; on a CPU try 16 first)")
    p.add_argument("--batch", type=int, default=64, help="levels per compiled rollout call")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (rollout.val_temperature); default: the run's config, else 0.5")
    p.add_argument("--max-turn", type=int, default=None, help="default: the run's config, else 5")
    p.add_argument("--response-length", type=int, default=None, help="default: the run's config, else 400")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    p.add_argument("--no-think", dest="enable_think", action="store_false", default=None,
                   help="answer with <answer> only, no <think> (rollout.enable_think=False): for a model that "
                        "cannot close <think>; default: the run's config, else thinking on")
    p.add_argument("--policy", choices=("model", "random-valid"), default="model",
                   help="random-valid: answer every turn with 1 to max_actions_per_turn uniformly random valid "
                        "actions, the board unread (the chance baseline); --model then gives only the config and "
                        "tokenizer")
    p.add_argument("--seed", type=int, default=None,
                   help="first level seed (envs.val.seed); default: the run's config, else 123 (RAGEN's)")
    p.add_argument("--out", default=None, help="results JSON; default: <run folder>/evaluate_<suite>_<levels>levels.json "
                   "beside a run, else bench_results/evaluate_<model>_<suite>_<levels>levels.json")
    return p.parse_args(argv)


def is_run_folder(source: str) -> bool:
    return (Path(source) / "config.json").is_file() and (Path(source) / "checkpoints").is_dir()


def default_out(model: str, suite: str, levels: int, policy: str = "model") -> Path:
    """Where results go without ``--out``: beside an evaluated run folder, else under a name that
    holds the model's; the suite and level count in the name, so evaluating another model, suite
    or number of levels (a 16-level first look beside the 256 levels) keeps the earlier results."""
    name = lambda text: re.sub(r"[^\w.+-]+", "_", text).strip("_") or "model"  # noqa: E731
    what = "" if policy == "model" else f"{policy}_"
    if is_run_folder(model):
        return Path(model) / f"evaluate_{what}{name(suite)}_{levels}levels.json"
    return Path("bench_results") / f"evaluate_{what}{name(model)}_{name(suite)}_{levels}levels.json"


def out_note(out: Path) -> str:
    """Where the results go, saying so when an earlier evaluation's file there is replaced."""
    return f"results go to {out}" + (" (replacing the earlier evaluation there)" if out.exists() else "")


def suite_tags(name: str) -> tuple[str, ...]:
    if name in SUITES:
        return SUITES[name]
    if envs_jax.is_known(name):
        return (name,)
    raise ValueError(f"Unknown suite {name!r}: use one of {', '.join(SUITES)} or an env name ({envs_jax.known_names()}).")


def evaluated_config(args):
    """The config an evaluation plays by: a run folder's own, else the base config with ``--model``
    and a dtype for this device; then the rollout flags given. A copy: the run's is not changed."""
    if is_run_folder(args.model):
        config = base.saved_config(Path(args.model) / "config.json")
    else:
        dtype = args.dtype or ("bfloat16" if _on_gpu() else "float32")
        config = base.with_overrides(base.get_config(), {"model.source": args.model, "model.dtype": dtype})
    flags = {"rollout.max_turn": args.max_turn or None, "rollout.response_length": args.response_length or None,
             "rollout.enable_think": args.enable_think, "rollout.val_temperature": args.temperature,
             "envs.val.seed": args.seed}
    return base.with_overrides(config, {key: value for key, value in flags.items() if value is not None})


def tag_config(config, tag: str, levels: int):
    """``config`` with its validation side set to ``levels`` levels of ``tag``, one row each (a copy)."""
    side = {"envs.val.tags": (tag,), "envs.val.n_groups": (levels,), "envs.val.group_size": 1}
    return base.with_overrides(config, side)


def check_evaluation(config, tags, batch: int):
    """Every check that needs no model, before it loads: the settings, the model's dtype, each tag's
    plan (its env and budgets), and the mesh against the batch of levels. Not ``check_config``,
    which checks the training side too (its batch split and mesh): an evaluation does not train,
    and a run trained on other devices must still evaluate here. Returns the mesh."""
    check_settings(config)
    model_compute(config)
    for tag in tags:
        rollout_plan(tag_config(config, tag, batch), "val")
    return device_mesh(config, **{"--batch": batch})


def load_evaluated_policy(config, source: str, trained: bool = True):
    """``(model, tokenizer)``: a run folder's trained policy (its latest checkpoint; not read unless
    ``trained``), else the model ``config`` names."""
    if trained and is_run_folder(source):  # found before the model loads
        if not checkpoint.saved_steps(Path(source) / "checkpoints"):
            raise CheckpointError(f"{Path(source) / 'checkpoints'} holds no saved step: the run has no trained "
                                  "policy to evaluate yet.")
        checkpoint.check_saved_files(Path(source) / "checkpoints")
    model, tokenizer = load_policy(config)
    if trained and is_run_folder(source):
        run_dir = Path(source)
        settings = train_settings(config, rollout_plan(config, "train"))
        state = init_train_state(settings, model, jax.random.PRNGKey(0))
        state, _, step, _ = checkpoint.restore(checkpoint.manager(run_dir / "checkpoints"), state)
        model = dataclasses.replace(model, params=policy_weights(settings, state))
        print(f"loaded {run_dir} at step {step}")
    return model, tokenizer


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def evaluate(args, checked=lambda: None) -> dict:
    """The report of ``args``' evaluation; ``checked()`` is called once the inputs are checked and
    the policy loaded, before the rollouts."""
    tags = suite_tags(args.suite)
    for flag, value in (("--levels", args.levels), ("--batch", args.batch)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, not {value}.")
    batch = min(args.batch, args.levels)
    if args.levels % batch:
        raise ConfigError(f"--levels ({args.levels}) must be a multiple of --batch ({batch}).")
    config = evaluated_config(args)
    mesh = check_evaluation(config, tags, batch)
    if args.policy == "random-valid":  # before the load: its answers need the envs' action names
        for tag in tags:
            check_named_actions(rollout_plan(tag_config(config, tag, batch), "val"))
    model, tokenizer = load_evaluated_policy(config, args.model, trained=args.policy == "model")
    checked()
    with sharding.use_mesh(mesh):
        policy = sharding.shard(sampling_policy(model.graphdef, model.params), mesh)
        results = evaluate_tags(config, tags, policy, tokenizer, args.levels, batch, args.policy == "random-valid")
    return {"model": args.model, "policy": args.policy, "suite": args.suite,
            "temperature": float(config.rollout.val_temperature), "first_seed": int(config.envs.val.seed),
            "enable_think": bool(config.rollout.enable_think),
            "device": jax.devices()[0].device_kind, "devices": len(mesh.devices.flat), "results": results}


def evaluate_tags(config, tags, policy, tokenizer, levels: int, batch: int, random_valid: bool = False) -> dict:
    """Success and friends per env tag, over ``levels`` fixed levels each, ``batch`` a call: the
    levels of seeds ``envs.val.seed`` on, continuing from tag to tag, at ``rollout.val_temperature``.
    ``random_valid``: uniformly random valid answers (``RandomAnswers``) instead of the policy's."""
    results, seed = {}, int(config.envs.val.seed)
    bar = tqdm(total=levels * len(tags), desc="evaluate", unit="level")
    for tag in tags:
        bar.set_postfix(env=tag)
        played = tag_levels(config, tag, levels, batch, tokenizer, policy.merge().config.vocab_size, seed, random_valid)
        seed += levels
        # Every tag from key 0: each plays its levels apart from the others'.
        result = fixed_levels.evaluate_levels(played, policy, jax.random.PRNGKey(0),
                                              float(config.rollout.val_temperature), "val",
                                              progress=lambda chunks: bar.update(chunks * batch))
        results[tag] = tag_results(result.metrics, tag, levels) | {"seconds": result.seconds}
    bar.close()
    return results


def tag_levels(config, tag: str, levels: int, batch: int, tokenizer, vocab_size: int, first_seed: int,
               random_valid: bool):
    """``levels`` levels of ``tag`` from seed ``first_seed`` on, one row each, ``batch`` a call
    (``diagnostics.fixed_levels``); answered by ``RandomAnswers`` when ``random_valid``."""
    one_tag = tag_config(config, tag, levels)
    plan, tables = tokenized_plan(one_tag, "val", rollout_plan(one_tag, "val"), tokenizer, vocab_size)
    chunks = levels // batch
    responder = RandomAnswers(chunk_plan(plan, chunks), answer_pieces(tokenizer, plan, tables)) if random_valid else None
    return fixed_levels.fixed_levels(plan, tables, first_seed, chunks, responder)


def tag_results(metrics: dict, tag: str, levels: int) -> dict:
    """One tag's row of the report, from its ``val/`` metrics over ``levels`` levels."""
    success = metrics[f"val/{tag}/success"]
    return {
        "success": success,
        "success_interval": wilson(round(success * levels), levels),
        "reward": metrics["val/reward/mean"],
        "num_actions": metrics[f"val/{tag}/num_actions"],
        "action_is_effective": metrics[f"val/{tag}/action_is_effective"],
        "action_is_valid": metrics[f"val/{tag}/action_is_valid"],
        "response_length": metrics["val/response_length"],
        "levels": levels,
    }


def format_table(report: dict) -> str:
    rows = [f"{'env':28s} {'success %':>10s} {'95 % interval':>15s} {'reward':>8s} {'actions':>8s} {'levels':>7s}"]
    for tag, r in report["results"].items():
        low, high = (100 * x for x in r["success_interval"])
        interval = f"[{low:.1f}, {high:.1f}]"
        rows.append(f"{tag:28s} {100 * r['success']:10.2f} {interval:>15s} {r['reward']:8.3f} {r['num_actions']:8.2f} "
                    f"{r['levels']:7d}")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else default_out(args.model, args.suite, args.levels, args.policy)

    setup_compilation_cache()  # before the first compile
    try:
        report = evaluate(args, checked=lambda: print(out_note(out), flush=True))
    except (ValueError, ConfigError, ModelLoadError, CheckpointError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(report))
    replaced = out.exists()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}" + (" (replaced the earlier evaluation there)" if replaced else ""))
    return 0
