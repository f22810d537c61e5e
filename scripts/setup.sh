#!/usr/bin/env bash
# setup.sh: installs what building and testing opfuse needs, or says what is
# missing. System packages through apt when run as root; Python packages into
# the local .venv. Safe to run again: it only installs what is absent.
set -eu
cd "$(dirname "$0")/.."

need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v make >/dev/null 2>&1 || need+=(make)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
[ -e /usr/include/x86_64-linux-gnu/cblas.h ] || [ -e /usr/include/cblas.h ] ||
  pkg-config --exists openblas 2>/dev/null || need+=(libopenblas-dev)
[ -e /usr/include/cjson/cJSON.h ] || need+=(libcjson-dev)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)

if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${need[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "setup: missing system packages: ${need[*]}" >&2
    echo "setup: install them with: sudo apt-get install ${need[*]}" >&2
    exit 1
  fi
fi

# Python packages for the oracle tests, in a local venv.
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
if ! .venv/bin/python -c 'import numpy, ml_dtypes, pytest' >/dev/null 2>&1; then
  echo "setup: installing numpy, ml_dtypes, pytest into .venv"
  .venv/bin/pip install -q numpy ml_dtypes pytest
fi

# The benchmarks' peer (PyTorch CPU), only for `make bench`.
if [ "${1:-}" = "--bench" ] && ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
  echo "setup: installing torch into .venv for the benchmark peer (large download)"
  .venv/bin/pip install -q torch || echo "setup: torch could not be installed; benchmarks will skip the PyTorch peer" >&2
fi
