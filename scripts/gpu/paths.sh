#!/usr/bin/env bash
# The KV, MoE and RL device paths on one GPU: their device tests, then `rfork bench kv|moe|rl --device`,
# within one time budget; logs, JSON and a summary in RESULTS_DIR.
#
#   bash scripts/gpu/paths.sh RESULTS_DIR BUDGET_S          # from the repository root
#
# scripts/gpu_check.sh calls it (section "paths") with the environment it set up: PYTHONPATH with the
# carried wheels, LD_LIBRARY_PATH, RFORK_LIBFABRIC_LIB (mpich's libfabric 2.5.1: tcp and shm, no CUDA
# support, so the paths stage through pinned host memory), GPU_CHECK_PYTHON and GPU_CHECK_SKIP_CUDA.
#
# Settings (environment):
#   PATHS_DEVICE        cuda (default), or cpu: the rehearsal (also chosen when GPU_CHECK_SKIP_CUDA=1),
#                       the same steps with CPU tensors standing in for the device and small sizes
#   PATHS_PROVIDER      the libfabric provider of the three benches (default shm: processes of one host)
#   PATHS_RL_SIZE_GIB   the RL update size (default 4, the goal's size, when the RL step has >= 150 s;
#                       else 1; 0.05 on cpu)
#   PATHS_STEPS         which steps to run (default "tests kv moe rl")
#
# Every step runs under `timeout` with its share of BUDGET_S (tests 15 %, kv 20 %, moe 25 %, rl the
# rest, each also bounded by the time left), and no step stops the others. Results:
#   RESULTS_DIR/{tests,bench-kv,bench-moe,bench-rl}.log, bench-{kv,moe,rl}.json, pytest-paths.xml,
#   paths-summary.txt (rc and seconds of each step, then each bench's goals).
set -uo pipefail
cd "$(dirname "$0")/../.."
R=${1:?usage: paths.sh RESULTS_DIR BUDGET_S}
BUDGET=${2:?usage: paths.sh RESULTS_DIR BUDGET_S}
mkdir -p "$R"
R=$(cd "$R" && pwd)
PY=${GPU_CHECK_PYTHON:-python3}
if [ -z "${PATHS_DEVICE:-}" ]; then
  if [ "${GPU_CHECK_SKIP_CUDA:-0}" != 0 ]; then PATHS_DEVICE=cpu; else PATHS_DEVICE=cuda; fi
fi
DEVICE=$PATHS_DEVICE
PROVIDER=${PATHS_PROVIDER:-shm}
STEPS=" ${PATHS_STEPS:-tests kv moe rl} "
export PYTHONUNBUFFERED=1 FI_TCP_IFACE=${FI_TCP_IFACE:-lo} RFORK_TCP_HOST=${RFORK_TCP_HOST:-127.0.0.1}
SUMMARY=$R/paths-summary.txt
T0=$(date +%s)
: >"$SUMMARY"

note() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

# step NAME SHARE_PERCENT COMMAND...: timeout = min(share of BUDGET, time left - 5 s)
step() {
  local name=$1 share=$2; shift 2
  if [[ "$STEPS" != *" ${name#bench-} "* ]]; then
    note "[$name] not asked for (PATHS_STEPS)"
    return 0
  fi
  local cap=$(( BUDGET * share / 100 )) budget
  budget=$(( $(left) - 5 ))
  [ "$budget" -gt "$cap" ] && budget=$cap
  if [ "$budget" -lt 10 ]; then
    note "[$name] SKIPPED: ${budget}s left"
    return 0
  fi
  local t; t=$(date +%s)
  echo "=== [$name] ${budget}s: $*" >>"$R/paths-run.log"
  timeout --kill-after=10 "$budget" "$@" >"$R/$name.log" 2>&1
  local rc=$? what=ok
  [ $rc -ne 0 ] && what="rc=$rc"
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && what="TIMED OUT after ${budget}s"
  note "[$name] $what in $(( $(date +%s) - t ))s (log: $name.log)"
  grep -E "^goal:|Error|error:|refuses" "$R/$name.log" | head -n 12 | sed "s/^/[$name]   /" >>"$SUMMARY"
  return 0
}

note "paths.sh: $(date -u +%FT%TZ) device=$DEVICE provider=$PROVIDER budget=${BUDGET}s python=$PY" \
  "libfabric=${RFORK_LIBFABRIC_LIB:-system}"

# ---------------------------------------------------------------- the device tests
TESTS=(tests/backends/kv/test_device.py tests/backends/moe/test_device.py
       tests/backends/rl/test_device.py)
if [ "$DEVICE" = cuda ]; then
  MARK=gpu  # the cuda-parametrised tests (the cpu ones ran where the tree was built)
else
  MARK="not slow"  # the rehearsal: the cpu stand-in tests; the cuda ones skip
  TESTS+=(tests/bench/test_device_paths.py)  # uses pytest-timeout's mark: only where that plugin is
fi
TIMEOUT=()
"$PY" -c "import pytest_timeout" >/dev/null 2>&1 && TIMEOUT=(--timeout 120)
step tests 15 "$PY" -m pytest -p no:cacheprovider -q -rA -m "$MARK" "${TIMEOUT[@]}" \
  --junitxml="$R/pytest-paths.xml" "${TESTS[@]}"

# ---------------------------------------------------------------- the benches
if [ "$DEVICE" = cuda ]; then
  KV=(--layers 32 --kv-heads 4 --head-dim 128 --prompts 1024,4096 --seconds 2)     # 16 KiB pages
  MOE=(--ranks 4 --tokens 128 --hidden 7168 --topk 8 --experts 256 --iters 50 --warmup 5)
  RL_SHARE=$(( BUDGET * 40 / 100 ))
  if [ "$RL_SHARE" -ge 150 ]; then RL_SIZE=${PATHS_RL_SIZE_GIB:-4}; else RL_SIZE=${PATHS_RL_SIZE_GIB:-1}; fi
  RL=(--receivers 3 --size-gib "$RL_SIZE" --repeat 2)
else
  KV=(--layers 4 --kv-heads 4 --head-dim 128 --prompts 256 --seconds 0.2)
  MOE=(--ranks 4 --tokens 16 --hidden 256 --topk 4 --experts 16 --iters 5 --warmup 1)
  RL=(--receivers 3 --size-gib "${PATHS_RL_SIZE_GIB:-0.05}" --repeat 1)
fi
step bench-kv 20 "$PY" -m rfork bench kv --device "$DEVICE" --provider "$PROVIDER" "${KV[@]}" --json "$R/bench-kv.json"
step bench-moe 25 "$PY" -m rfork bench moe --device "$DEVICE" --provider "$PROVIDER" "${MOE[@]}" \
  --json "$R/bench-moe.json"
step bench-rl 100 "$PY" -m rfork bench rl --device "$DEVICE" --provider "$PROVIDER" "${RL[@]}" --json "$R/bench-rl.json"

# ---------------------------------------------------------------- summary
{
  echo "--- tests"; grep -sE "passed|failed|error" "$R/tests.log" | tail -n 2
  "$PY" - "$R" <<'PYEOF'
import json, os, sys
root = sys.argv[1]
for name in ("kv", "moe", "rl"):
    path = os.path.join(root, f"bench-{name}.json")
    if not os.path.exists(path):
        print(f"--- bench {name}: no JSON")
        continue
    doc = json.load(open(path))
    m = doc.get("machine", {})
    print(f"--- bench {name} on {doc.get('device')}: {m.get('gpu', 'no GPU')}, torch {m.get('torch')}, "
          f"CUDA {m.get('cuda')}, libfabric {m.get('libfabric')} ({m.get('libfabric_library')})")
    for row in doc.get("rows", []):
        print("  " + json.dumps(row, sort_keys=True)[:400])
    for goal in doc.get("goals", []):
        print(f"  goal: {goal['goal']}: {goal['figure']} {goal['unit']} -> {'met' if goal['met'] else 'NOT met'}")
PYEOF
  echo "--- paths.sh elapsed $(( $(date +%s) - T0 ))s of ${BUDGET}s"
} >>"$SUMMARY" 2>&1
cat "$SUMMARY"
