#!/usr/bin/env bash
# A whole GPU lease in priority order (docs/benchmarks.md, "On a GPU"), each stage bounded so that
# the lot ends inside BUDGET_S seconds, each stage's output saved under OUT as soon as it ends:
#
#   paper   the paper's command, `experiments.run --config configs/sokoban.py`, end to end with
#           random Qwen2.5-0.5B weights: 3 steps with validation on VAL_LEVELS levels and a
#           checkpoint, then a resume of one more step, validation and the export. Compile times
#           (JAX_LOG_COMPILES), per-phase times and peak device memory (metrics.jsonl), the memory
#           plan's estimate (the run's first line), the run folder's sizes.
#   step    bench.step at N = 100 and 400 (this tree; OLD_TREE's beside it when set)
#   decode  gpu_decode_check.sh: copy bandwidth, decode bytes and HLO, decode speed, appends
#   bandit  configs/learn_bandit.py at the paper's batch (8 groups x 16), BANDIT_STEPS steps
#
#   OUT=/tmp/gpu BUDGET_S=540 bash experiments/bench/gpu_window.sh
#   STAGES="step decode" OUT=/tmp/gpu BUDGET_S=300 bash experiments/bench/gpu_window.sh  # a later call
#
# The paper stages can fill a whole call on their own (their first process is mostly compiling;
# docs/benchmarks.md has the times): run them alone in a lease's first call. Give that call a minute more than
# BUDGET_S, for the wheels' install and the stages' tarballs.
#
# Settings: STAGES (default "paper step decode bandit"), PAPER_ARGS (extra --config overrides of the
# paper's command, e.g. tiny shapes for a CPU smoke run), VAL_LEVELS (128), STEP_ARGS, OLD_TREE,
# BANDIT_ARGS, BANDIT_STEPS (40); PY, OUT, BUDGET_S, WHEELS as in gpu_lib.sh.
set -u
if [[ ${1-} == -h || ${1-} == --help ]]; then sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STAGES=${STAGES:-paper step decode bandit}
PAPER_ARGS=${PAPER_ARGS:-}
VAL_LEVELS=${VAL_LEVELS:-128}
STEP_ARGS=${STEP_ARGS:---response-tokens 100,400 --steps 3}
OLD_TREE=${OLD_TREE:-}
BANDIT_ARGS=${BANDIT_ARGS:-}
BANDIT_STEPS=${BANDIT_STEPS:-40}
source "$HERE/gpu_lib.sh"
wants() { [[ " $STAGES " == *" $1 "* ]]; }

# The paper's command twice in one run folder, each its own stage: 3 of 4 steps, then the resume
# that finishes it. A fresh compilation cache, so the first process compiles everything and the
# resume shows what the cache saves. jax's per-program log lines are cut to the compile times.
export PAPER_RUN="$WORK/paper_run" PAPER_CACHE="$WORK/paper_cache"
paper_process() {  # paper_process NAME EXTRA_FLAGS...
    local name=$1; shift
    local cmd=($PY -m experiments.run --config configs/sokoban.py --config.model.source=qwen2.5
               --config.model.random_init_preset=qwen2.5-0.5b "--config.envs.val.n_groups=($VAL_LEVELS,)"
               --config.trainer.total_steps=4 --config.trainer.output_dir="$PAPER_RUN" $PAPER_ARGS "$@")
    local t0=$(date +%s)
    STARPO_JAX_CACHE=$PAPER_CACHE JAX_LOG_COMPILES=1 "${cmd[@]}" 2>&1 \
        | grep --line-buffered -v -E '(pxla|dispatch)\.py:[0-9]+\] (Compiling|Finished (tracing|jaxpr))' >"$STAGE_OUT/run.log"
    echo "$name: rc=${PIPESTATUS[0]} $(( $(date +%s) - t0 )) s"
    grep -o 'Finished XLA compilation of [^ ]* in [0-9.]* sec' "$STAGE_OUT/run.log" | sort -t' ' -k7 -g >"$STAGE_OUT/compiles"
    awk '{n++; s+=$7} END {printf "%d programs compiled in %.1f s, the slowest:\n", n, s}' "$STAGE_OUT/compiles"
    tail -n 4 "$STAGE_OUT/compiles"
    grep -E '^(device memory|host memory|error|warning|resumed|policy|done|Traceback)|Error' "$STAGE_OUT/run.log" | tail -n 6
    du -sh "$PAPER_RUN"/* "$PAPER_CACHE" 2>&1
    cp "$PAPER_RUN/metrics.jsonl" "$STAGE_OUT/" 2>/dev/null && $PY - "$STAGE_OUT/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    keys = [k for k in m if k.startswith(("timing_s/", "perf/device_peak")) or k in ("val-env/success",)]
    print(m["step"], {k: round(m[k], 2) for k in keys})
PY
}
paper_first() { paper_process "first process (3 steps)" --max_steps=3; }
paper_resume() { paper_process "resume (1 step, validation, export)" --config.trainer.resume=True; rm -rf "$PAPER_RUN" "$PAPER_CACHE"; }
export -f paper_process paper_first paper_resume; export PY VAL_LEVELS PAPER_ARGS BANDIT_ARGS BANDIT_STEPS
wants paper && stage paper 450 "$ROOT" bash -c paper_first
wants paper && stage paper_resume 300 "$ROOT" bash -c paper_resume
if wants step; then
    stage step_new 300 "$ROOT" sh -c "$PY -m experiments.bench.step $STEP_ARGS --no-baseline --no-hf --out \$STAGE_OUT/step.json"
    [ -n "$OLD_TREE" ] && stage step_old 300 "$OLD_TREE" sh -c "PYTHONPATH=.:\${PYTHONPATH-} $PY -m experiments.bench.step $STEP_ARGS --no-baseline --no-hf --out \$STAGE_OUT/step.json"
fi
wants decode && STEP_ARGS= OLD_TREE= bash "$HERE/gpu_decode_check.sh"
if wants bandit; then
    bandit() {
        $PY -m experiments.run --config configs/learn_bandit.py "--config.envs.train.n_groups=(8,)" \
            --config.envs.train.group_size=16 --config.trainer.total_steps="$BANDIT_STEPS" \
            --config.trainer.output_dir="$STAGE_OUT/run" $BANDIT_ARGS
        cp "$STAGE_OUT/run/metrics.jsonl" "$STAGE_OUT/"; rm -rf "$STAGE_OUT/run"
    }
    export -f bandit; stage bandit 600 "$ROOT" bash -c bandit
fi
log "== done $(date -u +%T)"
