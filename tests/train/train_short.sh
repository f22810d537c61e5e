#!/bin/sh
# train_short.sh OPFUSE WORKDIR: `opfuse train` end to end on a tiny model.
#  - 40 steps reduce the evaluation loss under every recipe (the output
#    projection in bf16, or quantized too with --quantize-head);
#  - eager and compiled runs end in byte-identical checkpoints;
#  - a run stopped, saved and resumed ends byte-identical to an uninterrupted one;
#  - a 24-layer model builds and trains, eager and compiled;
#  - --compare writes its CSV and table;
#  - the command's usage when asked for, and on an unknown command;
#  - bad input (data file, shapes, device, checkpoints, a full disk while saving)
#    fails with a clear message, and a failed save leaves the checkpoint whole.
set -u
bin=$1
dir=$2
umount "$dir/full" 2>/dev/null  # the full-disk case's tmpfs, if a killed run left it
rm -rf "$dir" && mkdir -p "$dir" || exit 1
tiny="--layers 1 --width 64 --heads 2 --batch 16 --digits 2 --quiet"
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# the eval losses of a run's output, one per line
losses() { sed -n 's/.*eval loss \([0-9.]*\).*/\1/p' "$1"; }

for r in bf16 fp8-delayed fp8-current fp8-block mxfp8 nvfp4; do
    if ! "$bin" train $tiny --recipe $r --steps 40 --eval-every 10 >"$dir/$r.out" 2>&1; then
        fail "$r: training failed"; cat "$dir/$r.out"; continue
    fi
    first=$(losses "$dir/$r.out" | head -1)
    last=$(losses "$dir/$r.out" | tail -1)
    awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || fail "$r: eval loss $first -> $last"
    echo "$r: eval loss $first -> $last"
done

# the output projection stays bf16 under a quantized recipe unless --quantize-head
grep -q "recipe fp8-current (head bf16)" "$dir/fp8-current.out" || fail "fp8-current: the header does not say (head bf16)"
"$bin" train $tiny --recipe fp8-current --quantize-head --steps 40 --eval-every 10 >"$dir/qhead.out" 2>&1 ||
    { fail "--quantize-head: training failed"; cat "$dir/qhead.out"; }
grep -q "(head bf16)" "$dir/qhead.out" && fail "--quantize-head: the header still says (head bf16)"
cmp -s "$dir/fp8-current.out" "$dir/qhead.out" && fail "--quantize-head changed nothing"
first=$(losses "$dir/qhead.out" | head -1)
last=$(losses "$dir/qhead.out" | tail -1)
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || fail "--quantize-head: eval loss $first -> $last"

for r in bf16 fp8-delayed nvfp4; do
    "$bin" train $tiny --recipe $r --steps 12 --save "$dir/eager-$r" >/dev/null 2>&1 &&
    "$bin" train $tiny --recipe $r --steps 12 --compile --save "$dir/comp-$r" >/dev/null 2>&1 ||
        fail "$r: eager or compiled run failed"
    cmp -s "$dir/eager-$r/model.safetensors" "$dir/comp-$r/model.safetensors" ||
        fail "$r: eager and compiled checkpoints differ"

    "$bin" train $tiny --recipe $r --steps 12 --save-every 6 --save "$dir/whole-$r" >/dev/null 2>&1 &&
    "$bin" train $tiny --recipe $r --steps 12 --stop-after 6 --save "$dir/part-$r" >/dev/null 2>&1 &&
    "$bin" train $tiny --recipe $r --steps 12 --resume "$dir/part-$r" --save "$dir/part-$r" \
        >"$dir/resume-$r.out" 2>&1 || fail "$r: the interrupted run failed"
    grep -q "resumed from .* at step 6" "$dir/resume-$r.out" || fail "$r: did not resume at step 6"
    cmp -s "$dir/whole-$r/model.safetensors" "$dir/part-$r/model.safetensors" ||
        fail "$r: resumed run differs from the uninterrupted one"
done

# a deep model (GPT-2 medium's 24 blocks, 387 ops in one fuser group) builds
# and trains, eager and compiled
for m in "" --compile; do
    "$bin" train --layers 24 --width 32 --heads 2 --batch 4 --digits 2 --quiet --steps 2 \
        --eval-every 2 $m >"$dir/deep.out" 2>&1 || { fail "24 layers $m: training failed"; cat "$dir/deep.out"; }
done

# --compare: a CSV row per evaluation and recipe, and the table
"$bin" train $tiny --compare bf16,fp8-current --steps 4 --eval-every 2 --out "$dir/cmp" >"$dir/cmp.out" 2>&1 ||
    fail "--compare failed"
[ "$(grep -c '^fp8-current,' "$dir/cmp.csv")" -eq 2 ] || fail "--compare: want 2 fp8-current rows in cmp.csv"
grep -q '^| fp8-current ' "$dir/cmp.out" || fail "--compare: no table row for fp8-current"

# --profile: the phases (their sum is the step) and, compiled, the node groups; random tokens
"$bin" train $tiny --steps 3 --compile --profile --random-vocab 97 >"$dir/prof.out" 2>&1 ||
    fail "--profile failed"
grep -q "^profile over 2 steps" "$dir/prof.out" || fail "--profile: no phase table"
grep -q "^graph nodes by op class" "$dir/prof.out" || fail "--profile: no node table"
grep -Eq "^ +[0-9.]+ +[0-9.]+% +backward +attention \(1 node\)" "$dir/prof.out" ||
    { fail "--profile: no attention backward row:"; cat "$dir/prof.out"; }
grep -q "random tokens" "$dir/prof.out" || fail "--random-vocab: the header does not say random tokens"
grep -q "samples" "$dir/prof.out" && fail "--random-vocab: samples printed for random tokens"

# the command's usage: on stdout with status 0 when asked for (help, --help, -h
# after any command but train, which has its own), on stderr with 2 otherwise
for a in "help" "--help" "bench --help" "bench cuda -h" "demo --help"; do
    "$bin" $a >"$dir/usage.out" 2>&1 && grep -q "^usage: opfuse <command>" "$dir/usage.out" &&
        grep -q "bench train" "$dir/usage.out" || { fail "opfuse $a: no usage, rc 0"; cat "$dir/usage.out"; }
done
"$bin" nosuch >"$dir/usage.out" 2>&1
[ $? -eq 2 ] && grep -q "^usage: opfuse <command>" "$dir/usage.out" || fail "opfuse nosuch: not rc 2 with the usage"
"$bin" train --help 2>&1 | grep -q "^usage: opfuse train" || fail "opfuse train --help: not train's own usage"

# expect_error WANT ARGS...: fails with status 1 or 2 and a message containing WANT
expect_error() {
    want=$1; shift
    "$bin" train $tiny --steps 2 "$@" >"$dir/err.out" 2>&1
    rc=$?
    { [ $rc -eq 1 ] || [ $rc -eq 2 ]; } && grep -q -- "$want" "$dir/err.out" ||
        { fail "train $*: rc $rc, want \"$want\" in:"; cat "$dir/err.out"; }
}
: >"$dir/empty.txt"
expect_error "cannot read $dir/missing.txt" --data "$dir/missing.txt"
expect_error "is empty" --data "$dir/empty.txt"
expect_error "not divisible by 3 heads" --heads 3
expect_error "unknown device" --device tpu
# --device cuda trains where a GPU is, else says why
"$bin" train $tiny --steps 2 --device cuda >"$dir/cuda.out" 2>&1 ||
    grep -q "cannot use --device cuda: " "$dir/cuda.out" || { fail "--device cuda:"; cat "$dir/cuda.out"; }
expect_error "unknown recipe" --recipe fp6
expect_error "does not take --save" --compare bf16 --save "$dir/x"
expect_error "was saved with \"width 64\", this run has \"width 128\"" --resume "$dir/part-bf16" --width 128
expect_error "cannot resume from $dir/nothing" --resume "$dir/nothing"
cp "$dir/whole-bf16/model.safetensors" "$dir/good.safetensors"
head -c 100 "$dir/good.safetensors" >"$dir/whole-bf16/model.safetensors"
expect_error "cannot resume" --resume "$dir/whole-bf16" --recipe bf16
cp "$dir/good.safetensors" "$dir/whole-bf16/model.safetensors"

# A full disk while saving: the save fails with the system's message and the
# checkpoint already there stays whole. The disk is a tmpfs with room for one
# checkpoint but not a second where this user may mount one (root); else the
# file-size limit (ulimit -f, SIGXFSZ ignored) refuses the write the same way
# (OPF_TEST_NO_MOUNT=1 takes that way where root could mount).
"$bin" train $tiny --steps 2 --eval-every 2 --save "$dir/ck-full" >"$dir/full-a.out" 2>&1 ||
    { fail "full disk: the first save failed"; cat "$dir/full-a.out"; }
kb=$(du -sk "$dir/ck-full" | cut -f1)
mkdir -p "$dir/full"
if [ "$(id -u)" = 0 ] && [ -z "${OPF_TEST_NO_MOUNT:-}" ] && mount -t tmpfs -o size=$((kb * 3 / 2))k tmpfs "$dir/full" 2>/dev/null; then
    limit="" want="No space left on device"
else
    limit=$((kb / 2)) want="File too large"
    echo "train_short: no tmpfs to fill (not root, or mount refused): the file-size limit stands in"
fi
cp -r "$dir/ck-full" "$dir/full/ck" && cp -r "$dir/ck-full" "$dir/ck-before"
(
    [ -n "$limit" ] && { trap '' XFSZ; ulimit -f "$limit"; }
    exec "$bin" train $tiny --steps 4 --eval-every 2 --resume "$dir/full/ck" --save "$dir/full/ck"
) >"$dir/full-b.out" 2>&1
rc=$?
{ [ $rc -eq 1 ] && grep -q "opf_checkpoint_save: cannot write .*: $want" "$dir/full-b.out"; } ||
    { fail "full disk: rc $rc, want \"$want\" from opf_checkpoint_save in:"; cat "$dir/full-b.out"; }
for f in model.safetensors train.txt; do
    cmp -s "$dir/ck-before/$f" "$dir/full/ck/$f" || fail "full disk: $f changed by the failed save"
done
ls "$dir/full/ck" | grep -q '\.tmp\.' && fail "full disk: a temporary file was left behind"
[ -z "$limit" ] && umount "$dir/full"

[ $fails -eq 0 ] && echo "train_short: all passed" || echo "train_short: $fails failed"
exit $((fails != 0))
