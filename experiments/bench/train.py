"""Memory and time of one update (the learn phase): full fine-tuning over whole rows, over the
batch's layout (each group's first prompt once, rows cut to their used width), and LoRA.

    python -m experiments.bench.train                  # SmolLM2-135M shape (random weights), PPO + KL loss
    python -m experiments.bench.train --quick          # seconds: tiny model, smoke test

Workload: one compiled rollout of the untrained policy on the Bandit (``--groups`` × ``--group-size``
trajectories of up to ``--max-len`` tokens) gives a fixed batch; then ``learn`` — filter, old and
reference log-probs, values, advantages, critic and actor updates — is compiled and timed for each
mode on that same batch. PPO with a critic and the KL loss, so every copy of the weights that a run
holds is there: full fine-tuning keeps actor, critic and reference weights and Adam moments for
actor and critic; LoRA keeps one frozen base and small adapters (ragen-reference.md §5, paper App. D).

Reported per mode: bytes of the train state (trained weights, frozen weights, optimizer moments),
XLA's compiled memory analysis of ``learn`` (arguments, outputs and temporaries: what the device
must hold while it runs), compile time apart, and the median wall time of ``--repeats`` runs.
Ratios are LoRA, and the layout, over full fine-tuning on whole rows, measured in the same process.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import jax
from tqdm import tqdm

from configs import bandit, base
from experiments.bench.common import machine, require_positive, require_presets, write_report
from starpo_jax.forward import update_layout
from starpo_jax.runtime import allocator
from starpo_jax.runtime.experiment import build_experiment
from starpo_jax.runtime.planning import program_memory
from starpo_jax.train import init_train_state, make_train_step


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def state_bytes(state) -> dict[str, int]:
    """Bytes of what trains, what is frozen, and the optimizer moments."""
    return {
        "trained": tree_bytes((state.actor, state.critic)),
        "frozen": tree_bytes((state.base, state.ref)),
        "optimizer": tree_bytes((state.actor_opt, state.critic_opt)),
    }


def experiment_config(args):
    return base.with_overrides(bandit.get_config(), {
        "model.source": "smollm2-135m-instruct",  # its tokenizer; the weights are random
        "model.random_init_preset": args.model,
        "model.dtype": "float32",
        "envs.train.n_groups": (args.groups,),
        "envs.train.group_size": args.group_size,
        "envs.val.n_groups": (1, 1),
        "filter.ratio": 1.0,
        "rollout.enable_think": False,
        "rollout.response_length": args.response_length,
        "rollout.max_model_len": args.max_len,
        "actor.use_kl_loss": True,
        "actor.kl_loss_coef": 0.001,
        "actor.ppo_mini_batch_size": args.groups * args.group_size,
        "actor.micro_batch_size": args.micro_batch_size,
        "lora.alpha": args.lora_rank,
    })  # fmt: skip


def bench_mode(exp, traj, lora_rank: int, repeats: int, layout=None) -> dict:
    """``layout``: the update's ``UpdateLayout`` (None: every position of every row)."""
    settings = dataclasses.replace(exp.settings, lora_rank=lora_rank)
    state = init_train_state(settings, exp.model, jax.random.PRNGKey(0))
    learn = jax.jit(make_train_step(settings, exp.model.graphdef, exp.train_plan).learn, static_argnums=3)
    start = time.perf_counter()
    compiled = learn.lower(state, traj, exp.hyper, layout).compile()
    compile_s = time.perf_counter() - start
    memory = program_memory(compiled)
    if memory is None:  # XLA's CPU and GPU backends report one; nothing to measure without it
        raise RuntimeError(f"the {jax.default_backend()} backend reports no memory analysis of the compiled update")
    times = []
    for _ in tqdm(range(repeats), desc=f"learn lora_rank={lora_rank} layout={tuple(layout or ())}", unit="run", leave=False):
        start = time.perf_counter()
        jax.block_until_ready(compiled(state, traj, exp.hyper))
        times.append(time.perf_counter() - start)
    return {
        "lora_rank": lora_rank,
        "layout": None if layout is None else layout._asdict(),
        "state_bytes": state_bytes(state),
        "learn_bytes": memory.sizes(),
        "compile_s": compile_s,
        "run_s": times,
        "wall_s": statistics.median(times),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.bench.train",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model preset (random weights)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--max-len", type=int, default=320, help="tokens per trajectory")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--lora-rank", type=int, default=64, help="LoRA rank (alpha = rank, as RAGEN's base-lora)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. machine load)")
    p.add_argument("--out", default="bench_results/bench_train.json")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-llama, 1 x 2 trajectories, rank 4")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.groups, args.group_size, args.response_length = "tiny-llama", 1, 2, 8
        args.micro_batch_size, args.lora_rank, args.repeats = 2, 4, 1
    require_presets(p, [args.model])
    require_positive(p, args, "groups", "group_size", "response_length", "max_len", "micro_batch_size", "lora_rank",
                     "repeats")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)

    exp = build_experiment(experiment_config(args))
    state = init_train_state(exp.settings, exp.model, jax.random.PRNGKey(0))
    collect = jax.jit(make_train_step(exp.settings, exp.model.graphdef, exp.train_plan).collect)
    traj = jax.block_until_ready(collect(state, exp.train_tables, jax.random.PRNGKey(1)))
    full = bench_mode(exp, traj, 0, args.repeats)
    layout = update_layout(traj, exp.train_plan, exp.settings.micro_batch_size)
    laid_out = bench_mode(exp, traj, 0, args.repeats, layout)
    lora = bench_mode(exp, traj, args.lora_rank, args.repeats)
    held = lambda r: r["learn_bytes"]["arguments"] + r["learn_bytes"]["temporaries"]  # noqa: E731
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "workload": {"model": args.model, "trajectories": args.groups * args.group_size, "max_len": args.max_len,
                     "response_length": args.response_length, "micro_batch_size": args.micro_batch_size,
                     "estimator": "gae + KL loss", "env": "Bandit"},
        "machine": machine(args.note),
        "results": {"full": full, "layout": laid_out, "lora": lora},
        "lora_over_full": {
            "state_bytes": sum(lora["state_bytes"].values()) / sum(full["state_bytes"].values()),
            "learn_held_bytes": held(lora) / held(full),
            "wall_s": lora["wall_s"] / full["wall_s"],
        },
        "layout_over_full": {"learn_held_bytes": held(laid_out) / held(full), "wall_s": laid_out["wall_s"] / full["wall_s"]},
    }  # fmt: skip
    mb = lambda n: f"{n / 2**20:9.1f}"  # noqa: E731
    print(f"{'mode':<10} {'trained MB':>10} {'frozen MB':>10} {'optim MB':>10} {'learn args+temp MB':>19} "
          f"{'compile s':>10} {'wall s':>8}")
    for name, r in report["results"].items():
        s = r["state_bytes"]
        print(f"{name:<10} {mb(s['trained']):>10} {mb(s['frozen']):>10} {mb(s['optimizer']):>10} {mb(held(r)):>19} "
              f"{r['compile_s']:10.1f} {r['wall_s']:8.2f}")
    ratios = report["lora_over_full"]
    print(f"LoRA / full: state {ratios['state_bytes']:.2f}x, learn memory {ratios['learn_held_bytes']:.2f}x, "
          f"wall time {ratios['wall_s']:.2f}x")
    ratios = report["layout_over_full"]
    print(f"layout {tuple(layout)} / whole rows: learn memory {ratios['learn_held_bytes']:.2f}x, wall time {ratios['wall_s']:.2f}x")
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    allocator.restart_with_tcmalloc()  # first, before XLA starts: the process is replaced
    main()
