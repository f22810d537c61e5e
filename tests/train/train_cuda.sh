#!/bin/sh
# train_cuda.sh OPFUSE WORKDIR: `opfuse train --device cuda` on the tiny model
# (label cuda; exit 77 where no GPU or no CUDA build is):
#  - 50 steps under every recipe, eager and compiled, track the CPU run's
#    losses at each evaluation (train and eval loss): bf16 within bf16's
#    tolerance (rtol 1.6e-2, atol 1e-5), the quantized recipes within E4M3's
#    (rtol 0.125, atol 0.0675) and NVFP4 within E2M1's (rtol 0.25, atol 0.125)
#    (docs: the anchor's test tolerances, numerics.md 8.3);
#  - on the GPU, eager and compiled end in byte-identical checkpoints, and a
#    run stopped, saved and resumed equals an uninterrupted one.
# Every failing comparison is printed (recipe, step, both values), not only
# the first.
set -u
bin=$1
dir=$2
rm -rf "$dir" && mkdir -p "$dir" || exit 1
tiny="--layers 1 --width 64 --heads 2 --batch 16 --digits 2 --quiet --eval-every 10"
"$bin" train $tiny --steps 1 --device cuda >"$dir/probe.out" 2>&1
if grep -q "cannot use --device cuda" "$dir/probe.out"; then
    cat "$dir/probe.out"
    exit 77
fi
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# "step train eval" per evaluation line of a run's output
losses() { sed -n 's/^step *\([0-9]*\) *train loss \([0-9.naif-]*\) *eval loss \([0-9.naif-]*\).*/\1 \2 \3/p' "$1"; }

tols() {
    case $1 in
        bf16) echo "0.016 0.00001" ;;
        nvfp4) echo "0.25 0.125" ;;
        *) echo "0.125 0.0675" ;;
    esac
}

for r in bf16 fp8-delayed fp8-current fp8-block mxfp8 nvfp4; do
    for c in "" "--compile"; do
        tag="$r${c:+ compiled}"
        f="$dir/$r${c:+-compiled}"
        "$bin" train $tiny --steps 50 --recipe $r $c >"$f.cpu" 2>&1 || { fail "$tag: the CPU run failed"; cat "$f.cpu"; continue; }
        "$bin" train $tiny --steps 50 --recipe $r $c --device cuda >"$f.gpu" 2>&1 ||
            { fail "$tag: the CUDA run failed"; cat "$f.gpu"; continue; }
        losses "$f.cpu" >"$f.cpu.l"
        losses "$f.gpu" >"$f.gpu.l"
        set -- $(tols $r)
        bad=$(paste "$f.cpu.l" "$f.gpu.l" | awk -v rt="$1" -v at="$2" -v tag="$tag" '
            function off(a, b) { d = a - b; if (d < 0) d = -d; r = b < 0 ? -b : b; return !(d <= at || d <= rt * r) }
            NF != 6 { printf "  %s: evaluation %d missing on one side\n", tag, NR; n++; next }
            { if (off($5, $2)) { printf "  %s step %s: train loss cuda %s cpu %s\n", tag, $1, $5, $2; n++ }
              if (off($6, $3)) { printf "  %s step %s: eval loss cuda %s cpu %s\n", tag, $1, $6, $3; n++ } }
            END { if (NR == 0) { printf "  %s: no evaluation lines\n", tag; n++ } exit n > 0 }')
        if [ $? -ne 0 ]; then fail "$tag: the CUDA losses leave the tolerance ($1 rel, $2 abs):"; echo "$bad"
        else echo "$tag: $(wc -l <"$f.gpu.l") evaluations within tolerance"; fi
    done
done

# on the GPU: eager == compiled, and resumed == uninterrupted, byte for byte
for r in bf16 fp8-current; do
    "$bin" train $tiny --recipe $r --steps 12 --device cuda --save "$dir/eager-$r" >/dev/null 2>&1 &&
    "$bin" train $tiny --recipe $r --steps 12 --device cuda --compile --save "$dir/comp-$r" >/dev/null 2>&1 ||
        fail "$r: an eager or compiled CUDA run with --save failed"
    cmp -s "$dir/eager-$r/model.safetensors" "$dir/comp-$r/model.safetensors" ||
        fail "$r: eager and compiled CUDA checkpoints differ"
    "$bin" train $tiny --recipe $r --steps 12 --device cuda --save-every 6 --save "$dir/whole-$r" >/dev/null 2>&1 &&
    "$bin" train $tiny --recipe $r --steps 12 --device cuda --stop-after 6 --save "$dir/part-$r" >/dev/null 2>&1 &&
    "$bin" train $tiny --recipe $r --steps 12 --device cuda --resume "$dir/part-$r" --save "$dir/part-$r" \
        >"$dir/resume-$r.out" 2>&1 || fail "$r: the interrupted CUDA run failed"
    cmp -s "$dir/whole-$r/model.safetensors" "$dir/part-$r/model.safetensors" ||
        fail "$r: the resumed CUDA run differs from the uninterrupted one"
done

[ $fails -eq 0 ] && echo "train_cuda: all passed" || echo "train_cuda: $fails failed"
exit $((fails != 0))
