#!/usr/bin/env bash
# gpu.sh: on a machine with an NVIDIA GPU, build opfuse with CUDA, run the
# GPU tests (ctest -L cuda) and the GPU benchmarks (kernels; training
# steps) with their PyTorch peers in the same run, and print the tables
# last. Logs go to LOGDIR.
#
#     scripts/gpu.sh [LOGDIR]      default: build-gpu/logs
#
# A quicker partial run, for one kernel family while it is written:
#     OPF_GPU_TESTS=REGEX   run only the cuda tests whose name matches (ctest -R;
#                           the Python GPU tests are skipped then)
#     OPF_GPU_BENCH=0       skip the benchmarks and the peer
#     OPF_GPU_GPT=0         skip the GPT training benchmarks (the longest part,
#                           each size with torch.compile's warm-up); 1 (default):
#                           GPT-2 124M; 2: also 24 layers x 2048
#     OPF_GPU_RUN='CMD'     also CMD after the tests (below, before the benchmarks)
#     OPF_GPU_SKIP_TESTS=1  build, then go straight to the benchmarks (a second
#                           call on a still-warm machine: the build is reused)
# The order keeps the cheap, complete results first (a run cut short by a
# time limit still has them): tests, kernels with their peers, a profile of
# one GPT-2 124M step (opfuse train --profile), then the GPT benchmarks. The
# whole run takes longer than one 10-minute call on a shared machine; split
# it in two: OPF_GPU_GPT=0 first, then OPF_GPU_SKIP_TESTS=1 OPF_GPU_KERNELS=0
# for the GPT benchmarks alone.
#     OPF_GPU_SANITIZE=TOOL also each CUDA test program (test_cuda_*; those
#                           OPF_GPU_TESTS matches) under compute-sanitizer
#                           --tool TOOL (memcheck, racecheck, synccheck or
#                           initcheck), after the tests, OPF_GPU_SANITIZE_JOBS
#                           (default 4) at once; each cut off at
#                           OPF_GPU_SANITIZE_TIMEOUT s (default 120); the tests
#                           leave out their largest cases there (OPF_TEST_QUICK=1,
#                           tests/cuda/cuda_test.h; OPF_TEST_QUICK=0: all).
#                           cuDNN's own kernels are not checked
#                           (OPF_GPU_SANITIZE_EXCLUDE, the tool's kernel filter,
#                           default kns=cudnn_generated; empty: every kernel)
#     OPF_GPU_KERNELS=0     skip the kernel and training-step benchmarks, their
#                           peers and (unless OPF_GPU_PROFILE=1) the profile
#     OPF_GPU_PROFILE=0|1   the GPT-2 124M step profile on its own switch;
#                           OPF_GPU_PROFILE_RECIPES (default "bf16 fp8-current")
#     OPF_GPU_ONLY=LIST     bench cuda's sections (its --only: quantize, gemm,
#                           norm, elem, attn)
#     OPF_GPU_RECIPES=LIST  the recipes of the GPT benchmarks (bench train
#                           --recipes; default all six)
#     OPF_GPU_NCU=1         also every kernel of two eager GPT-2 124M steps
#                           under Nsight Compute, summed per kernel name
#                           (scripts/ncu_summary.py; OPF_GPU_NCU_RECIPE, default
#                           bf16); the run itself takes a minute or more.
#                           OPF_GPU_NCU=2: also each kernel's DRAM GB/s and SM
#                           throughput (% of peak), which tell latency-bound
#                           from bandwidth- or compute-bound (several replays
#                           a kernel: one step, a few minutes; give it a call
#                           of its own). OPF_GPU_NCU_TIMEOUT: its limit in s
#                           (default 300). OPF_GPU_NCU_LAYERS: the model's
#                           layers (default 12; 2 gives every kernel of a layer
#                           at a sixth of the time, the per-step ones once)
#
# The benchmarks time each case after OPF_BENCH_SETTLE_MS (default 300) of
# warm-up and start each process with OPF_BENCH_PREHEAT_MS (default 3000) of
# GEMMs, in the power-capped steady state (bench/bench_cuda.h); both 0: the
# older, burst-clock timing.
#
# Build dependencies the GPU machine lacks (cJSON; OpenBLAS if absent) come
# from Debian packages in .deps/ (ignored by git), unpacked into .deps/root:
#     mkdir -p .deps && (cd .deps && apt-get download libcjson1 libcjson-dev \
#         libopenblas0-pthread libopenblas-pthread-dev libgfortran5)
set -u -o pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build-gpu
logs=${1:-$build/logs}
mkdir -p "$logs"
cd "$root"

step() { printf '\n== %s (at %d s)\n' "$*" "$SECONDS"; }
# verdict: each cuda test that did not pass, by name, and ctest's summary line
verdict() {
  grep -E "^ *[0-9]+/[0-9]+ Test +#" "$logs/ctest.log" | grep -v " Passed " | sed 's/^/not passed: /'
  grep -E "tests passed|tests failed" "$logs/ctest.log" | tail -1 | sed 's/^/ctest -L cuda: /'
}
bench_rc=0
fresh=()  # the table logs this run wrote, printed at the end
# bench LOG CMD...: runs CMD with its output into LOG (appended), notes a failure
bench() {
  local log=$1; shift
  "$@" >>"$log" 2>&1 || { echo "FAILED (rc $?): $*" | tee -a "$log"; bench_rc=1; }
  case " ${fresh[*]} " in *" $log "*) ;; *) fresh+=("$log") ;; esac
}

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || exit 1
nvcc --version | tail -1
# cuDNN for OPF_CUDA_ATTENTION=cudnn: the machine has none of its own, only
# PyTorch's wheel (nvidia-cudnn-cu13, a namespace package: its __path__),
# whose include/ the build reads and whose lib/ (libcudnn.so.9, opened at run
# time) goes on LD_LIBRARY_PATH for the tests and benchmarks. None found:
# the path is compiled out and its tests and bench rows say so.
cudnn_dir=$(python3 - 2>/dev/null <<'PY'
import os
try:
    import nvidia.cudnn as m
except ImportError:
    raise SystemExit(0)
dirs = list(getattr(m, "__path__", [])) or [os.path.dirname(m.__file__ or "")]
print(next((d for d in dirs if os.path.isfile(os.path.join(d, "include", "cudnn_graph.h"))), ""))
PY
)
cudnn_cmake=()
if [ -n "$cudnn_dir" ]; then
  echo "cuDNN $(awk '/^#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) /{print $3}' \
    "$cudnn_dir/include/cudnn_version.h" | paste -sd.) (its headers; $cudnn_dir)"
  cudnn_cmake=(-DCUDNN_INCLUDE_DIR="$cudnn_dir/include")
  # its runtime-compiled engines (the fused attention ones) open NVRTC: the
  # toolkit's, next to the cudart and cuBLASLt opfuse links
  cuda_lib=$(dirname "$(command -v nvcc)")/../lib64
  export LD_LIBRARY_PATH="$cudnn_dir/lib:$cuda_lib:${LD_LIBRARY_PATH:-}"
else
  echo "cuDNN: none (python3 finds no nvidia.cudnn with headers): OPF_CUDA_ATTENTION=cudnn compiled out"
fi

# Packages: unpacked, never installed; the build finds them through the
# search paths below and links them by full path (rpath in the build tree).
prefix=$root/.deps/root
lib=$prefix/usr/lib/x86_64-linux-gnu
if compgen -G ".deps/*.deb" >/dev/null; then
  for f in .deps/*.deb; do dpkg -x "$f" "$prefix"; done
fi
need_cjson=1; [ -f /usr/include/cjson/cJSON.h ] && need_cjson=0
if [ $need_cjson = 1 ] && [ ! -f "$prefix/usr/include/cjson/cJSON.h" ]; then
  echo "gpu.sh: no cJSON headers here and none in .deps/ (see the header of this script)"; exit 1
fi
export CFLAGS="-I$prefix/usr/include -I$prefix/usr/include/x86_64-linux-gnu/openblas-pthread"
export LD_LIBRARY_PATH="$lib:$lib/openblas-pthread:${LD_LIBRARY_PATH:-}"

step "build (cmake + ninja)"
# OPF_CUDA_PTX=OFF: the H200's own machine code only, no PTX for later GPUs
# (a third less nvcc time; this build runs only here)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DOPF_CUDA=ON -DOPF_CUDA_PTX=OFF \
      ${cudnn_cmake[@]+"${cudnn_cmake[@]}"} \
      -DCMAKE_LIBRARY_PATH="$lib;$lib/openblas-pthread" >"$logs/cmake.log" 2>&1 \
  || { tail -30 "$logs/cmake.log"; exit 1; }
grep -E "cuDNN:" "$logs/cmake.log"
ninja -C "$build" -j16 >"$logs/build.log" 2>&1 || { grep -E "error|Error" -A5 "$logs/build.log" | head -60; exit 1; }
grep -E "warning" "$logs/build.log" | head -20
# the longest steps of this build (ninja's log): where a cold build's minutes go
awk -F'\t' 'NR > 1 { t[$4] = ($2 - $1) / 1000 } END { for (o in t) printf "%6.1f s  %s\n", t[o], o }' \
  "$build/.ninja_log" |
  sort -rn | head -4 | sed 's/^/longest build step: /'

# OPF_GPU_DIGEST_CORE=CORE: the digest test's golden file for OpenBLAS core
# CORE (SkylakeX, the base file's), written on this machine's CPU where it
# runs that core's kernels (AVX-512), into LOGDIR/golden.txt: how a change
# of numerics renews the lines that fp32 GEMMs feed, from a machine whose
# own core is another (tests/digest/test_digest.c)
if [ -n "${OPF_GPU_DIGEST_CORE:-}" ]; then
  step "digest golden file for OpenBLAS core $OPF_GPU_DIGEST_CORE"
  grep -qw avx512f /proc/cpuinfo || echo "this CPU has no AVX-512: SkylakeX kernels cannot run"
  OPENBLAS_CORETYPE=$OPF_GPU_DIGEST_CORE OPF_DIGEST_WRITE=1 "$build/test_digest" 2>&1 | tail -2
  cp tests/digest/golden.txt "$logs/golden.txt"
fi

ctest_rc=0
if [ "${OPF_GPU_SKIP_TESTS:-0}" != 1 ]; then
  step "ctest -L cuda (and cudnn)"
  # a test that hangs is cut off at 300 s rather than eat the session's GPU time
  (cd "$build" && ctest -L '^(cuda|cudnn)$' ${OPF_GPU_TESTS:+-R "$OPF_GPU_TESTS"} -V -j1 \
     --timeout 300) \
    >"$logs/ctest.log" 2>&1
  ctest_rc=$?
  grep -E "failed|FAIL|SKIP|tests passed|Passed|rel err" "$logs/ctest.log" | grep -v ", 0 failed" | tail -40
  verdict  # whatever the lines above cut off
  # the Python binding on CUDA tensors: the extension built into the same
  # tree, its GPU tests run with the machine's PyTorch (OPF_GPU_PY=0 skips)
  py=$(command -v python3 || true)
  if [ "${OPF_GPU_PY:-1}" != 0 ] && [ -z "${OPF_GPU_TESTS:-}" ] && [ -n "$py" ]; then
    step "pytest (CUDA tensors through the Python binding)"
    if ! "$py" -c "import torch, numpy, pytest, ml_dtypes" 2>"$logs/pytest.log"; then
      echo "skipped: python3 lacks a package the tests need:"; tail -1 "$logs/pytest.log"
    elif ! { cmake -S . -B "$build" -DOPF_PYTHON_EXT=ON -DOPF_PYTHON="$py" &&
             ninja -C "$build" -j16; } >>"$logs/pytest.log" 2>&1; then
      echo "the extension did not build:"; grep -E "error" -A3 "$logs/pytest.log" | head -20
      ctest_rc=1
    else
      PYTHONPATH="$build/python" "$py" -m pytest -q -p no:cacheprovider tests/python/test_cuda.py \
        tests/python/test_torch.py >>"$logs/pytest.log" 2>&1 || ctest_rc=1
      grep -E "passed|failed|Error|error" "$logs/pytest.log" | tail -15
    fi
  fi
fi

# OPF_GPU_SANITIZE=TOOL: the CUDA test programs under compute-sanitizer, one
# line each (clean, the errors it found, or cut off) and the first errors.
# test_cudnn_* are left out: they build cuDNN's graphs with no CUDA call,
# which the tool reports as an error of its own (no instrumented call).
# The tool keeps the host busy and the GPU mostly idle, so
# OPF_GPU_SANITIZE_JOBS programs (default 4) run at once.
sanitize_rc=0
sanitize_one() {  # TEST: its log and a verdict file in $logs
  local t=$1 name start rc v
  name=$(basename "$t")
  start=$SECONDS
  # API errors are not counted: the error-path tests provoke them on
  # purpose (a sync inside a capture, an allocation too large), and the
  # library reports each as an opf_status that the tests check
  # cuDNN's generated attention kernels are left out by default: racecheck
  # reports hazards between accesses inside each of them (1260 in
  # test_cuda_nn on Dec 4), which are not opfuse's to fix and which, 20
  # printed, would hide any in opfuse's own kernels
  local exclude=${OPF_GPU_SANITIZE_EXCLUDE-kns=cudnn_generated}
  OPF_TEST_QUICK=${OPF_TEST_QUICK:-1} timeout "${OPF_GPU_SANITIZE_TIMEOUT:-120}" \
    compute-sanitizer --tool "$OPF_GPU_SANITIZE" --report-api-errors no --error-exitcode 9 \
    ${exclude:+--kernel-name-exclude "$exclude"} --print-limit 20 "$t" \
    >"$logs/sanitize_$name.log" 2>&1
  rc=$?
  case $rc in
    0) v="clean" ;;
    77) v="skipped (the test's own skip)" ;;
    124) v="cut off at ${OPF_GPU_SANITIZE_TIMEOUT:-120} s (not checked to the end)" ;;
    9) v="ERRORS" ;;
    *) v="the test failed under the tool (rc $rc)" ;;
  esac
  printf '%d %-28s %-40s %4d s\n' "$rc" "$name" "$v" $((SECONDS - start)) >"$logs/sanitize_$name.rc"
}
if [ -n "${OPF_GPU_SANITIZE:-}" ]; then
  step "compute-sanitizer --tool $OPF_GPU_SANITIZE over the CUDA tests"
  : >"$logs/sanitize.log"
  if ! command -v compute-sanitizer >/dev/null; then
    echo "compute-sanitizer is not on this machine's PATH: skipped"
  else
    names=()
    for t in "$build"/test_cuda_*; do
      [ -x "$t" ] || continue
      name=$(basename "$t")
      [ -n "${OPF_GPU_TESTS:-}" ] && ! [[ $name =~ $OPF_GPU_TESTS ]] && continue
      while [ "$(jobs -rp | wc -l)" -ge "${OPF_GPU_SANITIZE_JOBS:-4}" ]; do wait -n; done
      sanitize_one "$t" &
      names+=("$name")
    done
    wait
    for name in "${names[@]}"; do
      rc=1 line="$name: no verdict (its job did not finish)"
      [ -f "$logs/sanitize_$name.rc" ] && read -r rc line <"$logs/sanitize_$name.rc"
      echo "$line" | tee -a "$logs/sanitize.log"
      case $rc in 0|77|124) ;; *)  # the tool's first lines, where it found something
        sanitize_rc=1
        grep -E "^=========" "$logs/sanitize_$name.log" | head -12 | tee -a "$logs/sanitize.log" ;;
      esac
    done
    fresh+=("$logs/sanitize.log")
  fi
  [ "$sanitize_rc" != 0 ] && ctest_rc=1
fi

# OPF_GPU_RUN='CMD': CMD (bash -c) after the tests, in this script's
# environment (the library paths; $build exported as OPF_BUILD), its output
# into LOGDIR/run.log and printed: a before / after of one switch, say
#     OPF_GPU_RUN='for m in 0 auto; do OPF_CUDA_SIDE=$m $OPF_BUILD/opfuse bench cuda-train --only small; done'
if [ -n "${OPF_GPU_RUN:-}" ]; then
  step "OPF_GPU_RUN"
  OPF_BUILD=$build bash -c "$OPF_GPU_RUN" >"$logs/run.log" 2>&1 || echo "OPF_GPU_RUN: rc $?"
  cat "$logs/run.log"
fi

[ "${OPF_GPU_BENCH:-1}" = 0 ] && exit "$ctest_rc"
if [ "${OPF_GPU_KERNELS:-1}" != 0 ]; then
  step "bench cuda"
  : >"$logs/bench_opfuse.log"
  bench "$logs/bench_opfuse.log" "$build/opfuse" bench cuda --out "$logs/bench_opfuse.txt" \
    ${OPF_GPU_ONLY:+--only "$OPF_GPU_ONLY"}
  cat "$logs/bench_opfuse.log"
  step "bench cuda-train"
  : >"$logs/bench_train.log"
  bench "$logs/bench_train.log" "$build/opfuse" bench cuda-train --out "$logs/bench_train.txt"
  cat "$logs/bench_train.log"
  step "PyTorch peers (kernels, then training steps)"
  : >"$logs/bench_peer.log"; : >"$logs/bench_peer_train.log"
  PYTHONUNBUFFERED=1 bench "$logs/bench_peer.log" python3 bench/peer/torch_cuda.py "$logs/bench_opfuse.txt"
  PYTHONUNBUFFERED=1 bench "$logs/bench_peer_train.log" python3 bench/peer/torch_cuda_train.py \
    "$logs/bench_train.txt"
fi
if [ "${OPF_GPU_PROFILE:-${OPF_GPU_KERNELS:-1}}" != 0 ]; then
  prof_recipes=${OPF_GPU_PROFILE_RECIPES:-bf16 fp8-current}
  step "profile: GPT-2 124M steps, compiled, $prof_recipes (device time per phase and op class)"
  : >"$logs/profile.log"
  for r in $prof_recipes; do
    bench "$logs/profile.log" "$build/opfuse" train --device cuda --layers 12 --width 768 --heads 12 \
      --context 1024 --random-vocab 50304 --batch 16 --steps 4 --eval-every 100 --compile --profile \
      --quiet --recipe $r
  done
fi
if [ "${OPF_GPU_NCU:-0}" != 0 ]; then
  # every kernel of two eager GPT-2 124M steps under Nsight Compute (its
  # duration, one pass a kernel, the clocks left alone; with 2 also the DRAM
  # bytes and SM throughput, replaying each kernel), summed per kernel name:
  # what the node-level --profile cannot split
  # OPF_GPU_NCU=2 replays every kernel several times: one step only, and
  # best in a call of its own (OPF_GPU_SKIP_TESTS=1 OPF_GPU_KERNELS=0
  # OPF_GPU_GPT=0 OPF_GPU_NCU=2): after the tests and benchmarks it ran past
  # a 10-minute call and came back empty
  nsteps=2; [ "$OPF_GPU_NCU" = 2 ] && nsteps=1
  step "kernel profile: ncu over $nsteps eager GPT-2 124M step(s) (${OPF_GPU_NCU_LAYERS:-12} layers), recipe ${OPF_GPU_NCU_RECIPE:-bf16}"
  if command -v ncu >/dev/null; then
    # cut off at OPF_GPU_NCU_TIMEOUT s, default 300 (ncu writes its CSV only
    # at the end, so then there is no table)
    metrics=gpu__time_duration.sum
    [ "$OPF_GPU_NCU" = 2 ] && metrics=$metrics,dram__bytes_read.sum,dram__bytes_write.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed
    timeout "${OPF_GPU_NCU_TIMEOUT:-300}" ncu --clock-control none --metrics "$metrics" --csv \
      --print-units base \
      "$build/opfuse" train --device cuda --layers "${OPF_GPU_NCU_LAYERS:-12}" --width 768 \
      --heads 12 --context 1024 --random-vocab 50304 --batch 16 --steps $nsteps --eval-every 100 --quiet \
      --recipe "${OPF_GPU_NCU_RECIPE:-bf16}" >"$logs/ncu.csv" 2>"$logs/ncu.err" ||
      { echo "ncu failed (rc $?):"; tail -5 "$logs/ncu.err"; bench_rc=1; }
    python3 scripts/ncu_summary.py "$logs/ncu.csv" --steps $nsteps --top 40 | tee "$logs/ncu.log"
    fresh+=("$logs/ncu.log")
  else
    echo "ncu is not on this machine's PATH: no kernel profile"
  fi
fi
gpt=${OPF_GPU_GPT:-1}
if [ "$gpt" != 0 ]; then
  step "bench train (the GPT of opfuse train per recipe; PyTorch bf16 eager and compiled in the same run)"
  : >"$logs/bench_gpt.log"
  recipes=(${OPF_GPU_RECIPES:+--recipes "$OPF_GPU_RECIPES"})
  OPF_PYTHON=python3 bench "$logs/bench_gpt.log" "$build/opfuse" bench train --device cuda \
    "${recipes[@]}"
  if [ "$gpt" = 2 ]; then
    OPF_PYTHON=python3 bench "$logs/bench_gpt.log" "$build/opfuse" bench train --device cuda \
      --layers 24 --width 2048 --heads 16 --batch 8 "${recipes[@]}"
  fi
fi
step "the tables (this run's)"
for f in "${fresh[@]}"; do
  case $f in */bench_opfuse.log|*/bench_train.log) ;; *) cat "$f" ;; esac
done
[ "${OPF_GPU_SKIP_TESTS:-0}" != 1 ] && verdict  # again last, where a tail shows it
[ "$ctest_rc" = 0 ] && [ "$bench_rc" != 0 ] && echo "gpu.sh: a benchmark failed (see FAILED above)"
[ "$ctest_rc" != 0 ] && exit "$ctest_rc"
exit "$bench_rc"
