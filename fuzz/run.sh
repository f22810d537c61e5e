#!/usr/bin/env bash
# run.sh: builds the fuzz targets with clang (libFuzzer + AddressSanitizer,
# build-fuzz/) and runs them one after the other.
#   fuzz/run.sh [SECONDS] [TARGET...]  fuzz each TARGET (api, checkpoint; default
#                           both) for SECONDS (default 300); new inputs go to
#                           fuzz/out/TARGET/corpus, crashing inputs to fuzz/out/TARGET/
#   FUZZ_SEED=N fuzz/run.sh ...  a fixed libFuzzer seed (make test: reproducible)
#   fuzz/run.sh --check     exit 0 when clang's libFuzzer links here, else say why
#   fuzz/run.sh --seeds     rewrite the checkpoint seed corpus fuzz/corpus/
set -eu
cd "$(dirname "$0")/.."
have_libfuzzer() {
  command -v clang >/dev/null || { echo "clang not found (apt-get install clang)"; return 1; }
  local tmp; tmp=$(mktemp -d)
  printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' >"$tmp/t.c"
  if ! clang -fsanitize=fuzzer,address "$tmp/t.c" -o "$tmp/t" 2>/dev/null; then
    rm -rf "$tmp"; echo "clang cannot link -fsanitize=fuzzer (libFuzzer runtime missing)"; return 1
  fi
  rm -rf "$tmp"
}
if [ "${1:-}" = "--check" ]; then
  why=$(have_libfuzzer) || { echo "$why"; exit 1; }
  exit 0
fi
why=$(have_libfuzzer) || { echo "run.sh: $why" >&2; exit 1; }
# Builds quietly (build-fuzz/build.log, shown when a step fails).
build() {
  "$@" >build-fuzz/build.log 2>&1 || { grep -E -A5 'error' build-fuzz/build.log | head -n 40
    echo "run.sh: build failed; log: build-fuzz/build.log" >&2; exit 1; }
}
mkdir -p build-fuzz
build env CC=clang cmake -S . -B build-fuzz -DOPF_FUZZ=ON -DOPF_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
if [ "${1:-}" = "--seeds" ]; then
  build cmake --build build-fuzz -j "${JOBS:-2}" --target make_corpus
  rm -f fuzz/corpus/*
  mkdir -p fuzz/corpus
  build-fuzz/make_corpus fuzz/corpus
  ls -l fuzz/corpus
  exit 0
fi
secs=${1:-300}
[ $# -gt 0 ] && shift
targets=${*:-api checkpoint}
for t in $targets; do
  case $t in
    api)        seeds=fuzz/corpus-api; extra="" ;;
    checkpoint) seeds=fuzz/corpus; extra="-dict=fuzz/checkpoint.dict" ;;
    *) echo "run.sh: unknown target $t (api, checkpoint)" >&2; exit 2 ;;
  esac
  build cmake --build build-fuzz -j "${JOBS:-2}" --target "fuzz_$t"
  mkdir -p "fuzz/out/$t/corpus"
  echo "run.sh: fuzz_$t for $secs s"
  # The whole output goes to fuzz/out/TARGET/log; the summary is shown.
  rc=0
  # shellcheck disable=SC2086
  build-fuzz/fuzz_$t -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 $extra \
    ${FUZZ_SEED:+-seed=$FUZZ_SEED} \
    -print_final_stats=1 -artifact_prefix="fuzz/out/$t/" "fuzz/out/$t/corpus" "$seeds" \
    >"fuzz/out/$t/log" 2>&1 || rc=$?
  grep -E '^Done|stat::number_of_executed_units|stat::average_exec_per_sec|stat::new_units_added' \
    "fuzz/out/$t/log" || true
  if [ "$rc" -ne 0 ]; then
    grep -E -A30 'ERROR|fuzz_api:|deadly signal' "fuzz/out/$t/log" | head -n 60
    echo "run.sh: fuzz_$t failed (log and inputs in fuzz/out/$t/)" >&2
    exit 1
  fi
done
