#!/usr/bin/env bash
# The GPU check, for a machine with a GPU, a CUDA build of torch, triton and nvcc:
#   bench/gpu_check.sh DIR [STEP ...]      (make gpu-check DIR=...)
# Default steps, in order: build (the CUDA kernels, for this GPU's architecture), accuracy, bench, host,
# kernels, sized for 8 minutes on an H100 after the build (each run's times: DIR/summary.txt). Steps:
#   accuracy: bench/accuracy.py, the triton backend's loss and gradient against the float64 reference
#     at B = 4096, 16384 and the 262144-row bank, float32 (torch's default precision and TF32), float16
#     and bfloat16; then float32 with triton-fp16x3's S tiles (accuracy-variants.txt); then rows of norms
#     30 and 300 compared as they are (--row-norm, exponents of 1e4-1e6) for the reference (torch's own
#     float32 ops), triton and, where built, cuda (accuracy-unnormalised-*.txt);
#   bench: the speed targets side by side, D = 512, as five parts that can also be named alone:
#     bench-float16: B = 1024, 4096, 16384, 65536 and the memory banks 1024 x 262144 and 1024 x 1048576
#       for matmul4 (the GEMM floor), triton, triton-direct (without its CUDA-graph replay), triton-graph,
#       triton-resident (the forward's negatives kernel on resident rows), triton-symmetric (the self case's
#       negatives pass on half the tiles; not the banks), triton-unmirrored (the self case's chunked backward
#       on every tile of each chunk's square; not the banks), compiled (torch.compile of the dense loss), pml;
#     bench-float32: B = 16384 for matmul4, triton, its float32 variants triton-unsplit (the backward's
#       products in float32, without their float16 pieces) and triton-fp16x3 (the S tiles as three
#       float16 products; bench/triton_internals.py), triton-unsymmetric (the self case's negatives pass on
#       every tile, where float32 on sm_90 ships half of them), triton-unmirrored, compiled, pml;
#     bench-xbm: CrossBatchMemory, B = 1000 against 55,000 rows, float16 and float32, ours and pml's;
#     bench-graphs: the CUDA graphs of both, triton-graph beside compiled-graph, B = 4096 and 16384;
#     bench-chunks: the chunked backward's budget, float16 B = 8192, 16384, 65536 and the 262144-row bank for
#       triton (256 MiB of pair weights) beside triton-chunk192 and triton-chunk128: time and peak memory;
#   bench-dtypes (on request): full runs of BENCH_DTYPES (default "bfloat16 float32-tf32");
#   host: bench/host_time.py (the host's time to issue a step, B = 1024 and 16384, and a bank's); with
#     BEFORE=another checkout, bench/host_time_versus.py (this checkout's step and that one's, taking turns);
#   kernels: bench/kernel_times.py (each kernel's time in one float16 step of the triton backend at
#     B = 1024, 4096, 16384 and a 1024 x 1048576 bank, and of triton-resident's, triton-symmetric's and
#     triton-unmirrored's; then float32 at B = 16384, triton's beside triton-fp16x3's, triton-unsymmetric's and
#     triton-unmirrored's;
#     KERNEL_PROVIDERS names others (triton-fused, cuda); where the GPU waits inside 10 steps timed from
#     an idle GPU; the Python functions that take the host's time, at B = 1024 those of the replayed step);
#   on request: tests (the suite, or the files in TESTS, on CUDA tensors, without the static compile
#     checks and the CPU emulation of CUDA, which need no GPU), sanitize (compute-sanitizer memcheck,
#     racecheck, synccheck on small cases of every kernel, the triton backend's fused and chunked
#     backward both), tune (bench/tune_triton.py: the Triton tile sweep, about 1.5 minutes a dtype;
#     TUNE_KINDS=backward skips the forward's, TUNE_DTYPES=float16 the other dtypes, TUNE_CANDIDATES=1 all
#     fused-backward and forward tiles but the shipped ones (the chunked backward's are all timed),
#     TUNE_SHAPES=1 the bank and gathered-batch shapes (the winners are the self case's); a later
#     bench-float16 of the same DIR adds the triton-tuned providers), profile (Nsight Compute on one
#     float16 step of each fused backend at B = 16384; PROFILE_BACKENDS=triton: that one alone, which needs
#     no build), experiment (bench/kanji_experiment.py --device cuda, EXPERIMENT_JOBS (default 14, all)
#     training runs at once; the kanjivg wheel in .whl/ for a machine without a registry).
# Logs and results go to DIR; DIR/summary.txt gets one line per step; the exit status is non-zero
# when a step failed. STEP_LIMIT (s) caps each step; DEADLINE (s) the whole check, whose steps past it are
# skipped (so that what a lease's call ran comes back with time to spare).
# pytorch-metric-learning wheels in .whl/ (a machine without a registry) are installed first.
set -uo pipefail
DIR=${1:?usage: bench/gpu_check.sh DIR [STEP ...]}
shift
STEPS=${*:-build accuracy bench host kernels}  # the others: on request
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)  # (relative to the caller's directory)
cd "$(dirname "$0")/.."
: >"$DIR/summary.txt"
failed=0
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
# The system compiler for every C++ build (the extension, and torch's JIT builds such as the tests'
# CUDA emulation), not the one Python's sysconfig names: on the GPU machines that is a GCC in /opt/gcc
# that links libstdc++ statically into the module, whose private iostreams then crash the process on
# the first error message that prints a number.
export CC=gcc CXX=g++ LDSHARED="gcc -shared" LDCXXSHARED="g++ -shared"
if ls .whl/*.whl >/dev/null 2>&1 && ! $PY -c "import pytorch_metric_learning" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/ms_loss_site .whl/*.whl
  export PYTHONPATH=/tmp/ms_loss_site${PYTHONPATH:+:$PYTHONPATH}
fi

run_step() {  # name, time limit (s), command...: log to DIR/name.log, one line to summary.txt
  local name=$1 limit=$(( $2 < ${STEP_LIMIT:-900} ? $2 : ${STEP_LIMIT:-900} )) start=$SECONDS
  local left=$(( ${DEADLINE:-100000} - SECONDS ))  # (DEADLINE: see the header)
  shift 2
  if [ $left -lt 20 ]; then
    echo "$name: skipped, past DEADLINE" | tee -a "$DIR/summary.txt"; failed=1; return
  fi
  limit=$(( limit < left ? limit : left ))
  timeout "$limit" "$@" >"$DIR/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || failed=1
  echo "$name: exit $rc, $((SECONDS - start)) s" | tee -a "$DIR/summary.txt"
  tail -n 4 "$DIR/$name.log"
}

bench_step() {  # one of the bench step's parts (see the header)
  case $1 in
  bench-float16)
    tuned=$([ -f "$DIR/tune.json" ] && echo triton-tuned)  # (a sweep in this DIR: its winners too)
    run_step bench-float16 420 $PY bench/benchmark.py --device cuda --dtype float16 --sizes 1024 4096 16384 65536 \
      --bank 262144 1048576 --providers matmul4 triton triton-direct triton-graph triton-resident triton-symmetric \
      triton-unmirrored compiled pml $tuned ${tuned:+--tuned "$DIR/tune.json"} \
      --repeats 15 --max-seconds 10 --out "$DIR/bench-float16" ;;
  bench-float32)
    run_step bench-float32 240 $PY bench/benchmark.py --device cuda --dtype float32 --sizes 16384 \
      --providers matmul4 triton triton-unsplit triton-fp16x3 triton-unsymmetric triton-unmirrored compiled pml \
      --repeats 5 --out "$DIR/bench-float32" ;;
  bench-xbm)
    for dtype in float16 float32; do
      run_step "bench-xbm-$dtype" 120 $PY bench/memory_benchmark.py --device cuda --dtype $dtype --providers ours pml \
        --out "$DIR/bench-xbm-$dtype"
    done ;;
  bench-graphs)
    run_step bench-graphs 240 $PY bench/benchmark.py --device cuda --dtype float16 --sizes 4096 16384 \
      --providers triton-graph compiled-graph --repeats 15 --out "$DIR/bench-graphs" ;;
  bench-chunks)
    run_step bench-chunks 180 $PY bench/benchmark.py --device cuda --dtype float16 --sizes 8192 16384 65536 \
      --bank 262144 --providers triton triton-chunk192 triton-chunk128 --repeats 15 --out "$DIR/bench-chunks" ;;
  bench-dtypes)
    for dtype in ${BENCH_DTYPES:-bfloat16 float32-tf32}; do
      run_step "bench-$dtype" 600 $PY bench/benchmark.py --device cuda --dtype ${dtype%-tf32} \
        $([ "$dtype" = float32-tf32 ] && echo --tf32) --sizes 4096 16384 65536 --bank 262144 1048576 \
        --max-seconds 10 --out "$DIR/bench-$dtype"
    done ;;
  *) echo "unknown step $1" | tee -a "$DIR/summary.txt"; failed=1 ;;
  esac
}

{ nvidia-smi; $PY -c "import torch, triton, sys; print(sys.version); print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  nvcc --version; } >"$DIR/env.log" 2>&1
for step in $STEPS; do
  case $step in
  build)
    arch=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
    run_step build 900 env TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="$(nproc)" \
      $PY -m pip install -v --no-build-isolation --no-deps -e .
    if nm -DC --defined-only ms_loss_cuda/_C*.so | grep -q "std::basic_ostream"; then
      echo "build: _C.so carries its own libstdc++ (linked statically)" | tee -a "$DIR/summary.txt"; failed=1
    fi ;;
  tests)
    xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n 12")
    run_step tests 900 $PY -m pytest -q -rs $xdist ${TESTS:-tests} --ignore=tests/test_triton_compile.py \
      --ignore=tests/test_cuda_compile.py -k "not cuda_emulated" --junitxml="$DIR/tests.xml" ;;
  sanitize)
    for backend in cuda triton; do
      run_step "sanitize-$backend-warmup" 300 $PY bench/gpu_sanitize.py --backend $backend  # compiles outside the tools
      for tool in memcheck racecheck synccheck; do
        run_step "sanitize-$backend-$tool" 600 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $tool \
          --error-exitcode 9 $PY bench/gpu_sanitize.py --backend $backend
      done
    done ;;
  tune)
    run_step tune 900 $PY bench/tune_triton.py --kinds ${TUNE_KINDS:-forward backward} \
      --dtypes ${TUNE_DTYPES:-float16 bfloat16 float32} --candidates ${TUNE_CANDIDATES:-8} --shapes ${TUNE_SHAPES:-3} --out "$DIR/tune.json" ;;
  bench)  # (all five in this order; each can also be named alone)
    for sub in bench-float16 bench-float32 bench-xbm bench-graphs bench-chunks; do bench_step $sub; done ;;
  bench-*) bench_step "$step" ;;
  kernels)
    run_step kernels 240 $PY bench/kernel_times.py --dtype float16 --shapes 1024 4096 16384 1024x1048576 --idle 10 \
      --cprofile 20 --providers ${KERNEL_PROVIDERS:-triton triton-resident triton-symmetric triton-unmirrored}
    run_step kernels-float32 120 $PY bench/kernel_times.py --dtype float32 --shapes 16384 --idle 10 \
      --providers triton triton-fp16x3 triton-unsymmetric triton-unmirrored ;;
  accuracy)  # the triton backend's error against the float64 reference at the benchmark's sizes
    run_step accuracy 120 $PY bench/accuracy.py --device cuda --sizes 4096 16384 --bank 262144 \
      --dtypes float32 float16 bfloat16 --precisions highest high --out "$DIR/accuracy.txt"
    run_step accuracy-variants 60 $PY bench/accuracy.py --device cuda --sizes 16384 --bank 262144 --dtypes float32 \
      --fp16x3 --out "$DIR/accuracy-variants.txt"
    for backend in reference triton $($PY -c "import ms_loss_cuda as m; print('cuda' * ('cuda' in \
m.available_backends('cuda')))"); do  # (rows as they are; the reference: torch's float32 ops)
      for norm in 30 300; do  # (triton's error grows with the norm: bench/results/cpu/unnormalised-rows.txt)
        run_step "accuracy-unnormalised-$backend-$norm" 60 $PY bench/accuracy.py --device cuda --backend $backend \
          --sizes 4096 --dtypes float32 --row-norm $norm --out "$DIR/accuracy-unnormalised-$backend-norm$norm.txt"
      done
    done ;;
  host)
    for batch in 1024 16384; do  # (the self case at B and a bank of 262144 rows)
      run_step "host-time-$batch" 120 $PY bench/host_time.py --device cuda --batch $batch --ref-rows 262144 \
        --dim 512 --steps 50 --rounds 3 --out "$DIR/host-time-$batch.txt"
    done
    if [ -n "${BEFORE:-}" ]; then  # another checkout carried along: the two side by side
      run_step host-time-versus 300 $PY bench/host_time_versus.py "$BEFORE" --device cuda --batch 16384 \
        --ref-rows 65536 --dim 512 --turns 10 --out "$DIR/host-time-versus.txt"
    fi ;;
  experiment)
    run_step experiment 600 $PY bench/kanji_experiment.py --device cuda --jobs "${EXPERIMENT_JOBS:-14}" \
      --data "$DIR/kanji-data" --out "$DIR/experiment-gpu" ;;
  profile)  # one float16 step of each fused backend at B = 16384, D = 512, under Nsight Compute
    for backend in ${PROFILE_BACKENDS:-triton cuda}; do
      run_step "profile-$backend" 300 ncu --clock-control none \
        --kernel-name regex:"minpos_kernel|negatives_kernel|finish_kernel|grad_kernel|weights_kernel|forward_kernel|backward_kernel" \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section SchedulerStats --section WarpStateStats $PY -c "
import torch, ms_loss_cuda
x = torch.randn(16384, 512, device='cuda', dtype=torch.float16).requires_grad_()
labels = torch.arange(16384, device='cuda') // 4
ms_loss_cuda.multi_similarity_loss(x, labels, backend='$backend').backward()
torch.cuda.synchronize()"
    done ;;
  *) echo "unknown step $step" | tee -a "$DIR/summary.txt"; failed=1 ;;
  esac
done
exit $failed  # non-zero when any step failed
