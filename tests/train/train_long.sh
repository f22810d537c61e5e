#!/bin/sh
# train_long.sh OPFUSE WORKDIR: the default `opfuse train` (3-digit addition,
# 2 layers x 64, bf16) converges: exact match of at least 50% on held-out sums.
set -u
mkdir -p "$2" || exit 1
"$1" train --steps 1500 --quiet >"$2/long.out" 2>&1 || { cat "$2/long.out"; exit 1; }
cat "$2/long.out"
acc=$(sed -n 's/.*exact match *\([0-9.]*\)%.*/\1/p' "$2/long.out" | tail -1)
awk -v a="$acc" 'BEGIN { exit !(a >= 50) }'
