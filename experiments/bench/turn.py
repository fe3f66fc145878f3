"""One turn of a multi-turn rollout, an append then a decode, or a trained policy's whole
validation rollout (``--policy``), timed in this source tree and in another checkout (``--tree``),
alternating (A B B A per round), each side in a process of its own: a before/after measurement of a
change to the KV-cached path, side by side in one run.

    python experiments/bench/turn.py --tree ../old                 # FrozenLake's later turns, 2 rounds
    python experiments/bench/turn.py --tree ../old --quick         # tiny-llama, seconds: a smoke run
    python experiments/bench/turn.py --tree ../old --playing 24    # 24 of the 64 rows still playing
    python experiments/bench/turn.py --tree ../old --group 8 --shared 272   # groups of 8 rows sharing a prompt
    python experiments/bench/turn.py --tree ../old --policy runs/fl_gigpo_s0 --rounds 1   # a run's validation

Workload (defaults: ``configs/learn_frozen_lake.py``'s second and third turns): ``--rows`` rows that
hold ``--held`` tokens of a ``--cache``-slot cache each append ``--append`` tokens (the next turn's
prompt; with ``--prompt N``, a block ``--append`` wide of which each row's first N are real, as the
rollout's block is as wide as its tables' longest prompt), then decode ``--new`` tokens (stop tokens
off, temperature 1; random float32 weights of ``--model``). The cache is donated to both calls, as
the rollout's program hands it from one to the next. With ``--group N`` the rows are prefix groups
of N whose caches begin with the same ``--shared`` tokens, as a rollout's copies of one first prompt
do (``KVCache.prefix_group``: the CPU attention kernel reads those slots once for a few rows). With
``--playing N`` only N of the rows play the turn (the others' episodes have ended) and the side
times the rollout's own turn, ``LLMResponder.respond``, as one call: the append and the decode are
not timed apart.

With ``--policy RUN`` the workload is a trained run's: its latest checkpoint plays ``--levels`` fixed
validation levels of its config's first validation env (or ``--env``) in one batch, by its
config's rollout settings, as ``experiments.evaluate`` plays them (``evaluate_levels`` from key 0,
so every call samples the same tokens). The episodes end when the policy's answers end them, so the
later turns run on the rows still playing. Each side reports the calls' seconds, what the rollout
did (rows playing each turn, success) and a hash of its sampled tokens: a change that should not
alter the sampling shows the same hash on both sides.

Each side reports the median over ``--repeats`` warm calls of what it times (the append, the decode
and their sum; the turn alone with ``--playing``; the rollout with ``--policy``), and its compile
times (with ``--policy``, the first call's seconds, compile included); the report gives every
side's figures and the ratio of the medians (``--tree`` over this tree: > 1 means this tree is
faster).

Run it as a file, not a module, so that each side imports its own tree's packages (only their public
API: ``models.preset``, ``Decoder``, ``ModelState``, ``sampling.init_cache``, ``append``, ``decode``;
``LLMResponder`` with ``--playing``; ``experiments.evaluate`` and ``fixed_levels`` with ``--policy``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
THIS_TREE = os.path.abspath(os.path.join(HERE, "..", ".."))
QUICK = {"model": "tiny-llama", "rows": 4, "cache": 64, "held": 16, "append": 8, "new": 8, "repeats": 1, "rounds": 1}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", default=THIS_TREE, help="the other checkout's root (default: this one, A against A)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model preset (random weights)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--cache", type=int, default=640, help="cache slots per row")
    p.add_argument("--held", type=int, default=300, help="tokens each row holds before the turn")
    p.add_argument("--append", type=int, default=90, help="tokens each row appends (the turn's prompt)")
    p.add_argument("--new", type=int, default=48, help="tokens each row decodes")
    p.add_argument("--group", type=int, default=1, help="rows of a prefix group, whose caches begin with the same "
                   "--shared tokens (a rollout's copies of one first prompt; default: every row its own)")
    p.add_argument("--shared", type=int, default=0, help="held tokens a prefix group's rows share (default 0)")
    p.add_argument("--prompt", type=int, help="real tokens of each row's appended block (default: all --append "
                   "of them); a rollout's block is as wide as the longest prompt its tables allow")
    p.add_argument("--playing", type=int, help="rows that play the turn (default: all): times LLMResponder.respond")
    p.add_argument("--policy", help="a run folder: time its policy's whole validation rollout instead of one turn")
    p.add_argument("--env", help="with --policy: the env whose levels it plays (default: the run's first validation env)")
    p.add_argument("--levels", type=int, default=64, help="with --policy: validation levels, played in one batch")
    p.add_argument("--repeats", type=int, default=3, help="warm calls timed per side and process (median)")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each runs both sides twice)")
    p.add_argument("--quick", action="store_true", help="tiny-llama, one round, one repeat: a smoke run")
    p.add_argument("--note", default="", help="free text for the report (machine load, ...)")
    p.add_argument("--out", default="bench_results/turn.json")
    p.add_argument("--side", help=argparse.SUPPRESS)  # set in the processes the rounds start
    if p.parse_known_args(argv)[0].quick:
        p.set_defaults(**QUICK)  # flags given beside --quick still win
    args = p.parse_args(argv)
    if args.held + args.append + args.new > args.cache:
        p.error(f"--held {args.held} + --append {args.append} + --new {args.new} tokens do not fit "
                f"a cache of {args.cache} slots")
    if args.prompt is not None and not 0 < args.prompt <= args.append:
        p.error(f"--prompt {args.prompt} must be between 1 and --append {args.append}")
    if not 0 < args.group <= args.rows:
        p.error(f"--group {args.group} must be between 1 and --rows {args.rows}")
    if not 0 <= args.shared <= args.held:
        p.error(f"--shared {args.shared} must be between 0 and --held {args.held}")
    if args.playing is not None and not 0 < args.playing <= args.rows:
        p.error(f"--playing {args.playing} must be between 1 and --rows {args.rows}")
    if args.policy is not None and not (os.path.isfile(os.path.join(args.policy, "config.json"))
                                        and os.path.isdir(os.path.join(args.policy, "checkpoints"))):
        p.error(f"--policy {args.policy} is not a run folder (it needs config.json and checkpoints/)")
    if args.policy is not None and not any(name.isdigit() for name in os.listdir(os.path.join(args.policy, "checkpoints"))):
        p.error(f"--policy {args.policy} holds no saved step: the run has no trained policy yet")  # a step's folder
    if args.policy is None and args.env is not None:
        p.error("--env chooses the levels of --policy's validation rollout: give --policy too")
    if not os.path.isdir(os.path.join(args.tree, "starpo_jax")):
        p.error(f"--tree {args.tree} has no starpo_jax package: give the root of a starpo-jax checkout")
    return args


def time_side(args) -> dict:
    """In a process of its own: time the turn with ``args.side``'s packages."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    sys.path.insert(0, args.side)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from starpo_jax.models import Decoder, ModelState, preset
    from starpo_jax.rollout import sampling

    if args.policy is not None:
        return time_validation(args)
    config = preset(args.model)
    model = ModelState.split(Decoder(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, config.vocab_size, (args.rows, args.append)).astype(np.int32)
    num_new = np.full((args.rows,), args.prompt or args.append, np.int32)

    def held_cache():
        cache = sampling.init_cache(config, args.rows, args.cache)
        # Keys and values apart: a cache may start them as one zeros array, which cannot be donated twice.
        return cache.replace(v=jax.tree.map(lambda x: jnp.array(x, copy=True), cache.v),
                             lengths=np.full((args.rows,), args.held, np.int32),
                             prefix_group=np.arange(args.rows, dtype=np.int32) // args.group,
                             prefix_length=np.full((args.rows,), args.shared, np.int32))

    if args.playing is not None:
        return time_responder(args, model, held_cache, tokens)
    append = jax.jit(lambda m, c, t, n: sampling.append(m, c, t, n), donate_argnums=1)
    decode = jax.jit(lambda m, c, logits, k: sampling.decode(m, c, logits, k, max_new_tokens=args.new),
                     donate_argnums=1)
    start = time.perf_counter()
    append_program = append.lower(model, held_cache(), tokens, num_new).compile()
    append_compile_s = time.perf_counter() - start
    cache, logits = jax.block_until_ready(append_program(model, held_cache(), tokens, num_new))
    start = time.perf_counter()
    decode_program = decode.lower(model, cache, logits, jax.random.key(0)).compile()
    decode_compile_s = time.perf_counter() - start
    jax.block_until_ready(decode_program(model, cache, logits, jax.random.key(0)))  # warm
    append_s, decode_s = [], []
    for r in range(args.repeats):
        cache = jax.block_until_ready(held_cache())
        start = time.perf_counter()
        cache, logits = jax.block_until_ready(append_program(model, cache, tokens, num_new))
        append_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        out = jax.block_until_ready(decode_program(model, cache, logits, jax.random.key(r + 1)))
        decode_s.append(time.perf_counter() - start)
        assert int(out.lengths.min()) == args.new  # stop tokens off: every row decoded the whole budget
    return {"tree": args.side, "append_s": append_s, "decode_s": decode_s,
            "turn_s": [a + d for a, d in zip(append_s, decode_s)],
            "append_compile_s": append_compile_s, "decode_compile_s": decode_compile_s}


def time_responder(args, model, held_cache, tokens) -> dict:
    """``--playing``: the rollout's later turn (``LLMResponder.respond``) with ``args.playing`` rows
    playing, spread over the batch; every playing row decodes ``args.new`` tokens."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import envs_jax
    from starpo_jax.rollout.multi_turn import LLMResponder, RolloutPlan, TagPlan

    plan = RolloutPlan(tags=(TagPlan("FrozenLake", envs_jax.make("FrozenLake"), args.rows, 10),), group_size=1,
                       response_length=args.new, max_len=args.cache)
    active = np.random.default_rng(1).permutation(args.rows) < args.playing
    num_new = np.where(active, args.prompt or args.append, 0).astype(np.int32)
    respond = jax.jit(lambda m, c, t, n, k, a: LLMResponder(plan, fixed_length=args.new).respond(
        m, c, t, n, k, 1.0, a, jnp.int32(1)), donate_argnums=1)
    start = time.perf_counter()
    program = respond.lower(model, held_cache(), tokens, num_new, jax.random.key(0), active).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(program(model, held_cache(), tokens, num_new, jax.random.key(0), active))  # warm
    turn_s = []
    for r in range(args.repeats):
        cache = jax.block_until_ready(held_cache())
        start = time.perf_counter()
        out = jax.block_until_ready(program(model, cache, tokens, num_new, jax.random.key(r + 1), active))
        turn_s.append(time.perf_counter() - start)
        lengths = np.asarray(out.lengths)
        assert (lengths[active] == args.new).all() and not lengths[~active].any()
    return {"tree": args.side, "turn_s": turn_s, "compile_s": compile_s}


def time_validation(args) -> dict:
    """``--policy``: the run's latest checkpoint on ``args.levels`` validation levels, one batch,
    sampled from key 0 on every call (``experiments.evaluate``'s rollout of one env)."""
    import hashlib

    import jax
    import numpy as np

    from experiments import evaluate
    from starpo_jax.diagnostics import fixed_levels
    from starpo_jax.rollout.sampling import sampling_policy
    from starpo_jax.runtime import sharding

    eval_args = evaluate.parse_args(["--model", args.policy, "--levels", str(args.levels), "--batch", str(args.levels)])
    config = evaluate.evaluated_config(eval_args)
    env = args.env or tuple(config.envs.val.tags)[0]
    mesh = evaluate.check_evaluation(config, (env,), args.levels)
    model, tokenizer = evaluate.load_evaluated_policy(config, args.policy)
    with sharding.use_mesh(mesh):
        policy = sharding.shard(sampling_policy(model.graphdef, model.params), mesh)
        levels = evaluate.tag_levels(config, env, args.levels, args.levels, tokenizer, policy.merge().config.vocab_size,
                                     int(config.envs.val.seed), False)

        def play():
            return fixed_levels.evaluate_levels(levels, policy, jax.random.PRNGKey(0),
                                                float(config.rollout.val_temperature), "val")

        first = play()
        calls = [play() for _ in range(args.repeats)]
    traj = jax.device_get(calls[0].traj)
    tokens = np.asarray(traj.tokens)
    assert all(np.array_equal(np.asarray(call.traj.tokens), tokens) for call in calls[1:])  # same key, same tokens
    return {"tree": args.side, "rollout_s": [call.seconds for call in calls], "compile_s": first.seconds,
            "env": env, "success": calls[0].metrics[f"val/{env}/success"],
            "rows_playing_per_turn": np.asarray(traj.turn_played).sum(0).tolist(),
            "response_tokens": int(np.asarray(traj.response_tokens).sum()),
            "tokens_sha1": hashlib.sha1(tokens.tobytes()).hexdigest()}


def run_side(args, tree: str, argv: list[str]) -> dict:
    """One side, timed in a fresh process (its own imports, its own compile caches)."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--side", tree],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"turn.py: the side of {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.side:
        record = time_side(args)
        print(json.dumps(record))
        return record
    sides = {"this": THIS_TREE, "other": os.path.abspath(args.tree)}
    runs: dict[str, list[dict]] = {"this": [], "other": []}
    order = ["other", "this", "this", "other"] * args.rounds
    for i, side in enumerate(order):
        record = run_side(args, sides[side], argv)
        runs[side].append(record)
        print(f"[{i + 1}/{len(order)}] {side:5} " + ", ".join(
            f"{part[:-2]} {statistics.median(record[part]):.2f} s" for part in parts(record)), flush=True)
    medians = {side: {part: statistics.median(t for r in records for t in r[part])
                      for part in parts(records[0])} for side, records in runs.items()}
    workload = (("policy", "env", "levels", "repeats", "rounds") if args.policy else
                ("model", "rows", "playing", "cache", "held", "append", "prompt", "new", "group", "shared", "repeats",
                 "rounds"))
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workload": {k: getattr(args, k) for k in workload},
        "machine": {"cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "note": args.note},
        "trees": sides, "order": order, "runs": runs, "medians": medians,
        "other_over_this": {part: medians["other"][part] / medians["this"][part] for part in medians["this"]},
    }
    if args.policy:  # did both trees sample the same tokens?
        report["same_tokens"] = len({r["tokens_sha1"] for records in runs.values() for r in records}) == 1
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({key: report[key] for key in ("medians", "other_over_this", "same_tokens") if key in report},
                     indent=1))
    return report


def parts(record: dict) -> list[str]:
    """The timed parts of a side's record: append, decode and the turn, the turn alone, or the rollout."""
    return [part for part in ("append_s", "decode_s", "turn_s", "rollout_s") if part in record]


if __name__ == "__main__":
    main()
