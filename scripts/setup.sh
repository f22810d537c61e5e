#!/usr/bin/env bash
# setup.sh: finds what `make demo`, `make test` or `make bench` needs and
# installs what is missing: Debian packages with apt-get when run as root
# (otherwise it names every missing package and stops), Python packages
# pinned in requirements.txt into the local .venv (tests and benchmarks only).
# Safe to run again: it only installs what is absent.
#
#   scripts/setup.sh [demo|test|bench] [--check]
#     demo     the compiler, CMake, OpenBLAS and cJSON (the default)
#     test     + pkg-config, Python 3 and the venv (numpy, ml_dtypes, pytest)
#     bench    + PyTorch in the venv, the benchmarks' peer (a large download;
#              OPF_BENCH_TORCH=0 skips it)
#     --check  only say what is missing (exit 1 if anything is), install nothing
#
# A dependency counts as present when what the build links is there: its
# pkg-config file or its shared library, never a header another package may
# provide (Debian's <triplet>/cblas.h comes from the reference BLAS,
# libblas-dev, as well as from OpenBLAS).
#
# OPF_SETUP_ROOT=DIR looks at the system installed under DIR instead of /
# (implies --check; tests/setup uses it). V=1 shows apt-get's and pip's output.
set -eu
cd "$(dirname "$0")/.."

mode=demo check=0
for arg in "$@"; do
  case $arg in
    demo | test | bench) mode=$arg ;;
    --check) check=1 ;;
    *) echo "usage: scripts/setup.sh [demo|test|bench] [--check]" >&2; exit 2 ;;
  esac
done
root=${OPF_SETUP_ROOT:-}
[ -z "$root" ] || check=1
log=build/setup.log

has_cmd() {
  if [ -z "$root" ]; then command -v "$1" >/dev/null 2>&1; return; fi
  local d
  for d in usr/local/bin usr/bin bin; do [ -x "$root/$d/$1" ] && return 0; done
  return 1
}

# The library directories the linker searches (any multiarch triplet).
lib_dirs() {
  local d
  for d in "$root"/usr/local/lib "$root"/usr/lib/*-linux-gnu "$root"/usr/lib \
           "$root"/usr/lib64 "$root"/lib/*-linux-gnu "$root"/lib64 "$root"/lib; do
    [ -d "$d" ] && echo "$d"
  done
  return 0
}

# pkg-config knows module $1 (under $root when set).
has_pc() {
  command -v pkg-config >/dev/null 2>&1 || return 1
  if [ -z "$root" ]; then pkg-config --exists "$1"; return; fi
  local path="" d
  for d in $(lib_dirs); do path=$path:$d/pkgconfig; done
  PKG_CONFIG_PATH= PKG_CONFIG_LIBDIR=${path#:}:$root/usr/share/pkgconfig PKG_CONFIG_SYSROOT_DIR=$root \
    pkg-config --exists "$1"
}

# -l$1 would link: lib$1.so in a library directory, or pkg-config module $2.
links() {
  local d
  has_pc "$2" && return 0
  for d in $(lib_dirs); do [ -e "$d/lib$1.so" ] && return 0; done
  return 1
}

# cc compiles and links a C program with OpenMP (only on the real system).
openmp_works() {
  [ -z "$root" ] || return 0
  local tmp rc
  tmp=$(mktemp -d)
  printf '#include <omp.h>\n#include <stdio.h>\nint main(void) { printf("%%d", omp_get_max_threads()); return 0; }\n' >"$tmp/t.c"
  cc -fopenmp "$tmp/t.c" -o "$tmp/t" >/dev/null 2>&1 && rc=0 || rc=1
  rm -rf "$tmp"
  return $rc
}

need=()
has_cmd make || need+=(make)
has_cmd cmake || need+=(cmake)
has_cmd cc || need+=(gcc)
[ -e "$root/usr/include/stdio.h" ] || need+=(libc6-dev)
links openblas openblas || need+=(libopenblas-dev)
links cjson libcjson || need+=(libcjson-dev)
if [ "$mode" != demo ]; then
  if [ "$mode" = test ]; then has_cmd pkg-config || need+=(pkg-config); fi
  has_cmd python3 || need+=(python3)
  # Debian moves ensurepip, which `python3 -m venv` needs, to python3-venv.
  if [ -z "$root" ]; then
    python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
  else
    compgen -G "$root/usr/lib/python3*/ensurepip/__init__.py" >/dev/null || need+=(python3-venv)
  fi
  # The tests build the Python package's C extension: Python.h.
  if [ "$mode" = test ]; then
    if [ -z "$root" ]; then
      python3 -c 'import os, sysconfig; exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        >/dev/null 2>&1 || need+=(python3-dev)
    else
      compgen -G "$root/usr/include/python3*/Python.h" >/dev/null || need+=(python3-dev)
    fi
  fi
fi

if [ ${#need[@]} -gt 0 ]; then
  if [ "$check" = 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${need[*]} with apt-get (log: $log)"
    mkdir -p build
    export DEBIAN_FRONTEND=noninteractive
    if [ "${V:-0}" = 1 ]; then
      apt-get update && apt-get install -y "${need[@]}"
    elif ! { apt-get update && apt-get install -y "${need[@]}"; } >"$log" 2>&1; then
      tail -n 30 "$log" >&2
      echo "setup: apt-get failed; full log: $log" >&2
      exit 1
    fi
  else
    echo "setup: missing for \`make $mode\`: ${need[*]}" >&2
    echo "setup: install them as root (Debian/Ubuntu package names), then run make again:" >&2
    echo "    sudo apt-get install ${need[*]}" >&2
    echo "  or, where there is no sudo:" >&2
    echo "    su -c 'apt-get install ${need[*]}'" >&2
    exit 1
  fi
fi
if ! openmp_works; then
  echo "setup: \`cc -fopenmp\` cannot build an OpenMP program; opfuse needs GCC's OpenMP (libgomp)," >&2
  echo "setup: which Debian's gcc brings (with clang: libomp-dev)" >&2
  exit 1
fi
[ "$check" = 0 ] || { echo "setup: nothing missing for \`make $mode\`"; exit 0; }
[ "$mode" != demo ] || exit 0

# Installs requirements file $1 into .venv, saying $3 first, unless the
# stamp .venv/opf-$2.txt shows the same lines went in already.
venv_install() {
  local stamp=.venv/opf-$2.txt
  cmp -s "$1" "$stamp" && return 0
  echo "setup: $3"
  mkdir -p build
  if [ "${V:-0}" = 1 ]; then
    .venv/bin/pip install -r "$1" || return 1
  elif ! .venv/bin/pip install -q -r "$1" >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "setup: pip failed; full log: $log" >&2
    return 1
  fi
  cp "$1" "$stamp"
}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
list=$(mktemp)
trap 'rm -f "$list"' EXIT
if [ "$mode" = test ]; then
  grep -E '^[A-Za-z]' requirements.txt | grep -v '^torch==' >"$list"
  venv_install "$list" test "installing the oracle tests' Python packages (requirements.txt) from PyPI into .venv"
  exit
fi

# bench: the PyTorch peer of `opfuse bench ops`.
if [ "${OPF_BENCH_TORCH:-1}" = 0 ]; then
  echo "setup: OPF_BENCH_TORCH=0: the benchmarks run without the PyTorch peer"
  exit 0
fi
grep '^torch==' requirements.txt >"$list"
if ! cmp -s "$list" .venv/opf-torch.txt; then
  echo "setup: \`make bench\` measures PyTorch on the CPU as its peer: $(cat "$list") from PyPI into .venv."
  echo "setup: A large download: the torch wheel alone is over 500 MB, and on x86-64 Linux pip adds"
  echo "setup: NVIDIA's CUDA libraries (several GB in all). \`make bench TORCH=0\` skips it."
  if [ -t 0 ]; then echo "setup: starting in 10 s (Ctrl-C to stop)"; sleep 10; fi
fi
venv_install "$list" torch "installing $(cat "$list")" ||
  echo "setup: torch could not be installed; the benchmarks run without the PyTorch peer" >&2
