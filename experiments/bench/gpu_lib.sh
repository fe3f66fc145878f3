# Shared by the GPU lease scripts (gpu_window.sh, gpu_decode_check.sh); sourced, not run.
# A lease is short and ends abruptly, so every stage is bounded in time and its output is saved
# (a tarball under OUT, a summary in OUT/session.log) as soon as it ends.
#
# Reads: PY (default python3), OUT (default bench_results/gpu), BUDGET_S (seconds for the whole
# script, default 560), WHEELS (default .whl: wheels of the packages the machine lacks, installed
# into /tmp/site first).
PY=${PY:-python3}
OUT=${OUT:-bench_results/gpu}; mkdir -p "$OUT"; export OUT
DEADLINE=${DEADLINE:-$(( $(date +%s) + ${BUDGET_S:-560} ))}; export DEADLINE
LOG="$OUT/session.log"; WORK=$(mktemp -d)
ROOT=$(pwd)
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
log() { echo "$@" | tee -a "$LOG"; }

# stage NAME CAP_S DIR CMD...: run CMD in DIR for at most CAP_S seconds (less if the budget is
# nearly spent), its output in WORK/NAME/log, then tar WORK/NAME into OUT/NAME.tar.gz. CMD sees
# its folder as STAGE_OUT.
stage() {
    local name=$1 cap=$2 dir=$3; shift 3
    local left=$(( DEADLINE - $(date +%s) )); (( left < cap )) && cap=$left
    if (( cap < 30 )); then log "== $name skipped: ${left}s left"; return; fi
    mkdir -p "$WORK/$name"; log "== $name (cap ${cap}s) $(date -u +%T)"
    (cd "$dir" && STAGE_OUT="$WORK/$name" timeout "$cap" "$@") >"$WORK/$name/log" 2>&1
    log "-- $name rc=$? $(date -u +%T)"; grep -v "^\s*$" "$WORK/$name/log" | tail -n 14 | tee -a "$LOG"
    tar -czf "$OUT/$name.tar.gz" -C "$WORK" "$name"
}

# Once per machine: the carried wheels, then what the card and the software are.
if [ -z "${GPU_LIB_READY-}" ]; then
    WHEELS=${WHEELS-.whl}
    if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
            && export PYTHONPATH=/tmp/site
    fi
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee -a "$LOG"
    fi
    $PY -c "import jax, flax, transformers; print('jax', jax.__version__, 'flax', flax.__version__,
'transformers', transformers.__version__, jax.devices())" 2>&1 | tail -n 2 | tee -a "$LOG"
    export GPU_LIB_READY=1
fi
