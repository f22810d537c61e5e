#!/usr/bin/env bash
# run.sh: builds the checkpoint-loader fuzz target with clang (libFuzzer +
# AddressSanitizer, build-fuzz/) and runs it.
#   fuzz/run.sh [SECONDS]   fuzz for SECONDS (default 300); new inputs go to
#                           fuzz/out/corpus, crashing inputs to fuzz/out/
#   fuzz/run.sh --seeds     rewrite the seed corpus fuzz/corpus/
set -eu
cd "$(dirname "$0")/.."
command -v clang >/dev/null || { echo "run.sh: needs clang (apt-get install clang)" >&2; exit 1; }
CC=clang cmake -S . -B build-fuzz -DOPF_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-fuzz -j "${JOBS:-2}" --target fuzz_checkpoint make_corpus >/dev/null
if [ "${1:-}" = "--seeds" ]; then
  rm -f fuzz/corpus/*
  mkdir -p fuzz/corpus
  build-fuzz/make_corpus fuzz/corpus
  ls -l fuzz/corpus
  exit 0
fi
mkdir -p fuzz/out/corpus
exec build-fuzz/fuzz_checkpoint -max_total_time="${1:-300}" -timeout=10 -rss_limit_mb=2048 \
  -dict=fuzz/checkpoint.dict -print_final_stats=1 -artifact_prefix=fuzz/out/ \
  fuzz/out/corpus fuzz/corpus
