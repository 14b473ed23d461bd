#!/usr/bin/env bash
# The one command of a GPU lease: install what rfork needs from the carried files, build the libfabric
# binding, then run every GPU check in timed sections, and leave ONE archive plus a summary in $OUT.
#
#   bash scripts/gpu_check.sh                      # on the GPU machine, from the repository root
#   GPU_CHECK_SKIP_CUDA=1 GPU_CHECK_PYTHON=.venv/bin/python OUT=/tmp/out bash scripts/gpu_check.sh
#                                                  # the rehearsal: every section runs what needs no CUDA
#
# Carried (beside the tree, path $GPU_CHECK_CARRY, default .gpu-carry): .whl/*.whl (cp312 wheels of
# rfork's dependencies the GPU image lacks or has too old: fastapi and its opentelemetry-api,
# typing-extensions for pydantic; and mpich==5.0.2, whose lib/mpich/libfabric.so.1 is libfabric 2.5.1
# with tcp and shm) and deb/*.deb (libfabric-dev/libfabric1 1.17 for the headers,
# libxxhash-dev/libxxhash0 for the native digests).
#
# Sections, in order, each under `timeout` and a share of one overall deadline (GPU_CHECK_TOTAL_S,
# default 450 s), none stopping the script:
#   setup   wheels into a scratch site (--target), debs unpacked, the cffi binding built
#   env     nvidia-smi, driver, torch/CUDA/cuda-python versions, libfabric and providers found
#   bench   python3 -m rfork bench gpu --size-gib $GPU_CHECK_SIZE_GIB (default 8) --json bench-gpu.json
#   tests   pytest -m gpu over the GPU test files (CUDA IPC, staging, the staged pull, the device digest),
#           at most GPU_CHECK_TESTS_S (default 150 s)
#   digest  python3 -m rfork bench digest --device cuda, if that option exists (GPU_CHECK_DIGEST_S, 90 s)
#   paths   scripts/gpu/paths.sh RESULTS_DIR BUDGET_S, if present (KV/MoE/RL on device buffers; its
#           budget: min(time left - 30 s, GPU_CHECK_PATHS_S, default 130 s))
#   cpu     the CPU tests of the GPU files, with whatever time is left
# GPU_CHECK_SECTIONS="bench tests" runs only those (after setup); on a warm machine setup then takes
# seconds (the scratch folder /tmp/gpu-check and the built binding stay between calls).
# Results: $OUT/gpu-results.tar.gz (every log and JSON), $OUT/summary.txt, $OUT/bench-gpu.json.
#
# paths.sh's interface: called as `bash scripts/gpu/paths.sh RESULTS_DIR BUDGET_S` from the repository
# root, with the environment this script set up (PYTHONPATH, LD_LIBRARY_PATH, RFORK_LIBFABRIC_LIB) and
# GPU_CHECK_PYTHON, GPU_CHECK_RESULTS (= RESULTS_DIR), GPU_CHECK_BUDGET_S (= BUDGET_S) and
# GPU_CHECK_SKIP_CUDA exported; it writes its logs and JSON into RESULTS_DIR and must end within BUDGET_S.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SELF=$ROOT/scripts/gpu_check.sh
if [ "${1:-}" = __section ]; then  # `bash gpu_check.sh __section NAME`: one section, in the parent's env
  SECTION=$2
else
  SECTION=
fi

T0=$(date +%s)
TOTAL_S=${GPU_CHECK_TOTAL_S:-450}
OUT=${OUT:-$ROOT/gpu-check-out}
CARRY=${GPU_CHECK_CARRY:-$ROOT/.gpu-carry}
PY=${GPU_CHECK_PYTHON:-python3}
SIZE_GIB=${GPU_CHECK_SIZE_GIB:-8}
SKIP_CUDA=${GPU_CHECK_SKIP_CUDA:-0}
WORK=${GPU_CHECK_WORK:-/tmp/gpu-check}  # kept on a warm machine: a rerun skips what setup did already
SECTIONS=" ${GPU_CHECK_SECTIONS:-env bench tests paths digest cpu} "  # setup always runs (fast when done)
R=$WORK/results
SITE=$WORK/site
FAB=$WORK/fab
SUMMARY=$R/summary.txt
export GPU_CHECK_WORK=$WORK
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 FI_TCP_IFACE=lo RFORK_TCP_HOST=127.0.0.1
export RFORK_ALLOW_UNENFORCED_ACCESS=1 HYPOTHESIS_STORAGE_DIRECTORY=$WORK/hypothesis

if [ "$SKIP_CUDA" != 0 ]; then
  export CUDA_VISIBLE_DEVICES=""  # torch sees no GPU: every CUDA part refuses or skips, the rest runs
elif ! command -v nvidia-smi >/dev/null 2>&1; then
  SKIP_CUDA=1
fi
export GPU_CHECK_SKIP_CUDA=$SKIP_CUDA GPU_CHECK_PYTHON=$PY R

note() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }
left() { echo $(( TOTAL_S - ($(date +%s) - T0) )); }

# section NAME CAP_S COMMAND...: run with a timeout of min(CAP_S, time left - 20 s), log to NAME.log,
# record rc and seconds; never stops the script.
section() {
  local name=$1 cap=$2; shift 2
  if [ "$name" != setup ] && [[ "$SECTIONS" != *" ${name%%-*} "* ]]; then
    note "[$name] not asked for (GPU_CHECK_SECTIONS)"
    return 0
  fi
  local budget; budget=$(left); budget=$(( budget - 20 ))
  [ "$budget" -gt "$cap" ] && budget=$cap
  if [ "$budget" -lt 5 ]; then
    note "[$name] SKIPPED: no time left"
    return 0
  fi
  local t=$(date +%s)
  echo "=== [$name] start (budget ${budget}s, $(( $(date +%s) - T0 ))s into the run)" | tee -a "$R/run.log"
  timeout --kill-after=10 "$budget" "$@" >"$R/$name.log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t ))
  local what=ok
  [ $rc -ne 0 ] && what="rc=$rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && what="TIMED OUT after ${budget}s"
  note "[$name] $what in ${dt}s (log: $name.log)"
  tail -n 3 "$R/$name.log" | sed "s/^/[$name]   /" >>"$SUMMARY"
  return 0
}

# ---------------------------------------------------------------- setup
setup() {
  set -e
  local ver; ver=$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')
  echo "python $ver at $(command -v "$PY")"
  local wheels=("$CARRY"/.whl/*.whl)
  local stamp; stamp="$SITE/.installed-$(ls "$CARRY"/.whl | cksum | cut -d' ' -f1)"  # a new carry installs again
  if [ -f "$stamp" ]; then
    echo "wheels installed by an earlier run on this machine: $SITE"
  elif [ -e "${wheels[0]}" ]; then
    if [ "$ver" = 312 ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[@]}"
      touch "$stamp"
      echo "installed ${#wheels[@]} wheels into $SITE"
    else
      # rehearsal on another Python: prove the cp312 set installs (resolution only), use this env's packages
      "$PY" -m pip install -q --dry-run --no-index --no-deps --ignore-installed --only-binary=:all: \
        --python-version 3.12 --implementation cp --target "$SITE/dry" \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_5_x86_64 \
        --platform manylinux1_x86_64 --platform any "${wheels[@]}"
      echo "python $ver is not 3.12: checked that the ${#wheels[@]} cp312 wheels install (dry run); using this env"
    fi
  else
    echo "no wheels under $CARRY/.whl: using the packages this python has"
  fi
  for deb in "$CARRY"/deb/*.deb; do
    if [ -e "$deb" ]; then dpkg -x "$deb" "$FAB"; fi
  done
  local libdir=$FAB/usr/lib/x86_64-linux-gnu
  [ -e "$FAB/usr/include/rdma/fabric.h" ] || { echo "libfabric headers missing (no libfabric-dev deb)"; return 1; }
  mkdir -p "$FAB/prefix" "$WORK/bin"
  ln -sfn "$FAB/usr/include" "$FAB/prefix/include"
  ln -sfn "$libdir" "$FAB/prefix/lib"
  # _libfabric_build.py asks pkg-config about libxxhash: answer from the unpacked deb
  cat >"$WORK/bin/pkg-config" <<EOF
#!/bin/sh
case "\$*" in
  *libxxhash*)
    case "\$1" in
      --cflags-only-I) echo "-I$FAB/usr/include" ;;
      --libs-only-L) echo "-L$libdir" ;;
    esac
    [ -e "$FAB/usr/include/xxhash.h" ] ; exit \$? ;;
esac
exit 1
EOF
  chmod +x "$WORK/bin/pkg-config"
  if [ -f "$WORK/.built" ] && ls backends/providers/_libfabric*.so >/dev/null 2>&1; then
    echo "binding built by an earlier run on this machine: $(ls backends/providers/_libfabric*.so)"
    return 0
  fi
  if [ "$SKIP_CUDA" != 0 ] && ls backends/providers/_libfabric*.so >/dev/null 2>&1; then
    # a rehearsal in a working checkout keeps its binding (its test suite may be using it): rehearse
    # the build itself from a copy of the tree (git ls-files | tar), where there is none
    echo "rehearsal: keeping this checkout's binding $(ls backends/providers/_libfabric*.so)"
    return 0
  fi
  rm -f backends/providers/_libfabric*.so
  # cffi, pycparser and setuptools may come from the carried wheels: the scratch site goes first
  PATH=$WORK/bin:$PATH RFORK_LIBFABRIC_PREFIX=$FAB/prefix PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} \
    "$PY" backends/providers/_libfabric_build.py \
    >"$R/build.log" 2>&1 || { tail -n 30 "$R/build.log"; return 1; }
  ls backends/providers/_libfabric*.so
  touch "$WORK/.built"
  echo "built the binding against libfabric 1.17 headers (and xxHash) from the carried debs"
}

# ---------------------------------------------------------------- env facts
env_facts() {
  echo "--- uname"; uname -a
  echo "--- cpus/memory/disk"; nproc; free -g; df -h /tmp "$ROOT" | cat
  echo "--- nvidia-smi"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
    --format=csv 2>&1 || echo "(no nvidia-smi)"
  nvidia-smi 2>&1 | head -n 20 || true
  nvidia-smi topo -m 2>&1 | head -n 10 || true
  echo "--- python"
  "$PY" - <<'PYEOF'
import json, os, platform, sys
facts = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import torch
    facts.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        facts.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                     capability=f"{p.major}.{p.minor}", uuid=str(p.uuid))
except Exception as exc:
    facts["torch_error"] = repr(exc)
from importlib import metadata
for pkg in ("cuda-bindings", "cuda-core", "safetensors", "numpy", "fastapi", "sqlalchemy", "cffi", "mpich",
            "blake3", "pytest", "pytest-timeout", "hypothesis"):
    try:
        facts[pkg] = metadata.version(pkg)
    except Exception:
        facts[pkg] = None
bad = {}
for mod in ("fastapi", "uvicorn", "sqlalchemy", "alembic", "pydantic", "pydantic_settings", "orjson", "blake3",
            "httptools", "safetensors", "xxhash", "planner.app", "rfork"):
    try:
        __import__(mod)
    except Exception as exc:
        bad[mod] = repr(exc)
facts["import_errors"] = bad
try:
    import backends, rfork
    facts["backends_from"] = os.path.dirname(backends.__file__)
    from backends.providers import _native
    facts["libfabric"] = "%d.%d" % _native.VERSION
    facts["libfabric_library"] = _native.LIBRARY or "system"
    facts["native_digests"] = bool(_native.lib.rf_hjob_supported())
    from backends import provider_available
    facts["tcp"] = provider_available("tcp", "127.0.0.1")
    facts["shm"] = provider_available("shm")
except ImportError as exc:
    facts.setdefault("import_error", repr(exc))
except Exception as exc:
    facts["libfabric_error"] = repr(exc)
try:
    from backends.gpu import driver
    facts["cuda_python_driver"] = driver.available()
    if driver.available() and facts.get("cuda_available"):
        d = driver.shared_driver()
        facts["dmabuf_supported"] = d.dmabuf_supported(0)
except Exception as exc:
    facts["cuda_python_error"] = repr(exc)
print(json.dumps(facts, indent=1, default=str))
with open(os.path.join(os.environ["R"], "env.json"), "w") as f:
    json.dump(facts, f, indent=1, default=str)
PYEOF
}

if [ -n "$SECTION" ]; then
  "$SECTION"
  exit $?
fi

rm -rf "$R"
mkdir -p "$OUT" "$R" "$SITE" "$FAB"
note "gpu_check: $(date -u +%FT%TZ) host $(hostname) skip_cuda=$SKIP_CUDA size=${SIZE_GIB}GiB python=$PY"
section setup 120 bash "$SELF" __section setup
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export LD_LIBRARY_PATH=$FAB/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# libfabric 2.5.1 from the mpich wheel (tcp and shm); RFORK_LIBFABRIC_LIB=system keeps the unpacked 1.17
if "$PY" -c 'import backends.providers._native as n; raise SystemExit(n.mpich_libfabric() is None)' \
    >/dev/null 2>&1; then
  export RFORK_LIBFABRIC_LIB=${RFORK_LIBFABRIC_LIB:-mpich}
fi
note "[setup] RFORK_LIBFABRIC_LIB=${RFORK_LIBFABRIC_LIB:-system}"

section env 30 bash "$SELF" __section env_facts

# ---------------------------------------------------------------- weights: rfork bench gpu
section bench 170 "$PY" -m rfork bench gpu --size-gib "$SIZE_GIB" --json "$R/bench-gpu.json"
if [ "$SKIP_CUDA" != 0 ]; then
  grep -qs "needs a CUDA GPU" "$R/bench.log" && note "[bench] refused without CUDA, as expected in the rehearsal"
  # the bench's own code, two processes and the staged paths, on the CPU (the disk rows would drop
  # this machine's page cache: they are left to the unit tests here)
  section bench-cpu 120 "$PY" -m rfork bench gpu --rehearse-on-cpu --size-gib 0.25 --skip disk \
    --json "$R/bench-gpu-rehearsal.json"
fi

# ---------------------------------------------------------------- GPU tests
# ours, and any other test file with gpu-marked tests (the device digest's...), except the KV/MoE/RL
# paths (paths.sh runs those) and the framework suites (their own venvs)
mapfile -t OTHER_GPU_TESTS < <(grep -rlE "pytest\.mark\.gpu|mark\.gpu" tests --include='test_*.py' 2>/dev/null \
  | grep -vE "^tests/(backends/gpu|backends/(kv|moe|rl)|sglang|vllm)/|test_staged_gpu|tests/bench/test_gpu" | sort)
GPU_TESTS=(tests/backends/gpu/test_cuda_ipc.py tests/backends/gpu/test_ipc_driver.py tests/backends/gpu/test_staging.py
           tests/rfork/pull/test_staged_gpu.py tests/bench/test_gpu.py "${OTHER_GPU_TESTS[@]}")
note "[tests] files: ${GPU_TESTS[*]}"
section tests "${GPU_CHECK_TESTS_S:-150}" "$PY" -m pytest -p no:cacheprovider -m gpu -q -rA --timeout 60 \
  --junitxml="$R/pytest-gpu.xml" "${GPU_TESTS[@]}"

# ---------------------------------------------------------------- device digest (if the option exists)
if [[ "$SECTIONS" != *" digest "* ]]; then
  :
elif "$PY" -m rfork bench digest --help 2>/dev/null | grep -q -- "--device"; then
  section digest "${GPU_CHECK_DIGEST_S:-90}" "$PY" -m rfork bench digest --device cuda --sizes-gib 1 2 4 --json "$R/bench-digest-device.json"
else
  note "[digest] rfork bench digest has no --device option in this tree: skipped"
fi

# ---------------------------------------------------------------- KV / MoE / RL device paths
if [[ "$SECTIONS" != *" paths "* ]]; then
  :
elif [ -f scripts/gpu/paths.sh ]; then
  mkdir -p "$R/paths"
  paths_cap=${GPU_CHECK_PATHS_S:-130}  # the KV/MoE/RL benches at their goal sizes want ~420 s
  budget=$(( $(left) - 30 )); [ "$budget" -gt "$paths_cap" ] && budget=$paths_cap
  export GPU_CHECK_RESULTS=$R/paths GPU_CHECK_BUDGET_S=$budget
  section paths $(( budget + 10 )) bash scripts/gpu/paths.sh "$R/paths" "$budget"
else
  note "[paths] scripts/gpu/paths.sh is not in this tree: skipped"
fi

# ---------------------------------------------------------------- the CPU tests of the GPU files
section cpu 90 "$PY" -m pytest -p no:cacheprovider -m "not gpu" -q --timeout 60 \
  --junitxml="$R/pytest-cpu.xml" tests/backends/gpu tests/bench/test_gpu.py tests/rfork/pull/test_staged.py \
  tests/rfork/pull/test_one_sided.py

# ---------------------------------------------------------------- summary and archive
{
  echo "--- pytest -m gpu"; grep -sE "passed|failed|error" "$R/tests.log" | tail -n 3
  grep -sE "^(PASSED|FAILED|ERROR|SKIPPED)" "$R/tests.log" | head -n 40
  echo "--- cpu tests"; grep -sE "passed|failed|error" "$R/cpu.log" | tail -n 2
  if [ -f "$R/paths/paths-summary.txt" ]; then
    echo "--- paths (KV/MoE/RL on the device: paths/paths-summary.txt)"; cat "$R/paths/paths-summary.txt"
  fi
  if [ -f "$R/bench-gpu.json" ]; then
    echo "--- bench gpu (bench-gpu.json)"
    "$PY" - "$R/bench-gpu.json" <<'PYEOF'
import json, sys
doc = json.load(open(sys.argv[1]))
m = doc["machine"]
print(f"{m.get('gpu')} driver {m.get('driver')} torch {m.get('torch')} CUDA {m.get('cuda')} "
      f"cuda-bindings {m.get('cuda_bindings')} libfabric {m.get('libfabric')}; {m.get('bytes', 0) / 2**30:.2f} GiB")
for r in doc["rows"]:
    gb = r.get("gb_per_s")
    print(f"  {r['source']:<40} {r.get('seconds', 0):9.4f} s  {gb if gb is None else round(gb, 2)!s:>8} GB/s"
          f"  verified={r.get('verified', '')}  {r.get('page_cache', '')}")
for g in doc["goals"]:
    print(f"  goal: {g['goal']}: {g['figure']} {g['unit']} -> {g['met']}")
for e in doc["errors"]:
    print(f"  error: {e}")
PYEOF
  fi
  echo "--- elapsed $(( $(date +%s) - T0 )) s"
} >>"$SUMMARY" 2>&1
cp "$SUMMARY" "$OUT/summary.txt"
[ -f "$R/bench-gpu.json" ] && cp "$R/bench-gpu.json" "$OUT/bench-gpu.json"
for f in "$R"/paths/bench-*.json; do [ -f "$f" ] && cp "$f" "$OUT/paths-$(basename "$f")"; done
tar czf "$OUT/gpu-results.tar.gz" -C "$WORK" results
cat "$OUT/summary.txt"
echo "results: $OUT/gpu-results.tar.gz ($(du -h "$OUT/gpu-results.tar.gz" | cut -f1))"
