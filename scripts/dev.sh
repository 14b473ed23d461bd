#!/usr/bin/env bash
# One entry point for a fresh machine: installs what rfork needs (system packages included), then
#   scripts/dev.sh demo [ARGS]   runs `rfork demo`
#   scripts/dev.sh test [ARGS]   runs lint (ruff), types (mypy) and the whole test suite (pytest)
#   scripts/dev.sh setup         only installs
#   scripts/dev.sh test-sglang [ARGS]  only the SGLang integration tests, in their own venv ($SGLANG_VENV)
# `test` without ARGS also installs SGLang into its own venv (about 3 minutes and 11 GB the first time)
# and runs tests/sglang there; the rest of the suite keeps the fast env (.venv, torch 2.13.0 CPU).
# Re-running is cheap: the Python install is skipped while pyproject.toml and setup files are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${RFORK_VENV:-.venv}
TORCH_PIN=torch==2.13.0
SGLANG_VENV=${RFORK_SGLANG_VENV:-.venv-sglang}  # gets SGLang's own torch pin through `.[sglang]`

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
  command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
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
    log "and Python headers with your package manager (Fedora: dnf install libfabric-devel gcc python3-devel),"
    log "or point RFORK_LIBFABRIC_PREFIX at a libfabric install (AWS EFA: /opt/amazon/efa)."
    exit 1
  fi
}

ensure_python_env() {
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  local stamp="$VENV/.rfork-setup-stamp" want
  want=$(cat pyproject.toml setup.py backends/_libfabric_build.py | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -n "$(ls backends/_libfabric*.so 2>/dev/null)" ]; then
    return 0
  fi
  log "installing Python packages into $VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel cffi
  "$VENV/bin/python" -m pip install -q "$TORCH_PIN"
  "$VENV/bin/python" -m pip install -q -e ".[dev]"
  echo "$want" >"$stamp"
}

ensure_sglang_env() {
  [ -x "$SGLANG_VENV/bin/python" ] || "$PYTHON" -m venv "$SGLANG_VENV"
  local stamp="$SGLANG_VENV/.rfork-setup-stamp" want
  want=$(cat pyproject.toml setup.py backends/_libfabric_build.py | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  log "installing SGLang and rfork into $SGLANG_VENV (first time: about 3 minutes, 11 GB)"
  "$SGLANG_VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel cffi
  "$SGLANG_VENV/bin/python" -m pip install -q -e ".[sglang,dev]"
  echo "$want" >"$stamp"
}

run_sglang_tests() {
  ensure_sglang_env
  log "pytest (SGLang integration, $SGLANG_VENV)"
  [ $# -gt 0 ] || set -- tests/sglang
  "$SGLANG_VENV/bin/python" -m pytest -m sglang "$@"
}

cmd=${1:-setup}; [ $# -gt 0 ] && shift
ensure_system_packages
ensure_python_env
export PATH="$PWD/$VENV/bin:$PATH"
case "$cmd" in
  setup) log "ready: activate with 'source $VENV/bin/activate'" ;;
  demo) exec rfork demo "$@" ;;
  test)
    log "ruff"; ruff check .
    log "mypy"; mypy
    log "pytest"
    if [ $# -gt 0 ]; then exec pytest "$@"; fi
    status=0; pytest || status=$?
    run_sglang_tests || status=$?
    exit $status ;;
  test-sglang) run_sglang_tests "$@" ;;
  *) log "usage: scripts/dev.sh setup|demo|test|test-sglang [ARGS]"; exit 2 ;;
esac
