#!/usr/bin/env bash
# One run on a machine with a GPU, for whoever holds one: install the
# checkout, run the kernel and optimizer-step benches, then the GPU test
# tier in two parts (one process; then several ranks over NCCL), each under
# its own deadline (about 8 minutes in all), printing every figure. Where
# there are fewer GPUs than ranks, the NCCL ranks share one GPU through
# tests/nccl_ranks.py (each rank its own NCCL_HOSTID, sockets on the loopback).
# PROFILES=1 adds the step's profiles and its host time (about 3 minutes more).
#
#   bash benchmarks/gpu_check.sh 2>&1 | tee gpu_check.log
set -u
cd "$(dirname "$0")/.."
step() {  # step SECONDS TITLE CMD...: run CMD with a deadline, report its status, go on
  local limit=$1 title=$2; shift 2
  echo "=== $title (limit ${limit}s) ==="
  local t0=$SECONDS
  timeout "$limit" "$@"
  echo "=== $title: exit $? after $((SECONDS - t0)) s ==="
}
python -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"
# The figures first (each short), then the tier, so a slow test cannot cost them.
step 90 "bench kernels (each kernel's share of the copy bandwidth)" \
  python -m onebit.bench kernels --device cuda --min-exp 20 --max-exp 28
step 30 "every rank's row in one launch, against a launch per row" \
  python -m benchmarks.rows_calls --device cuda
step 45 "bench optim, 100M params in 50 tensors" python -m onebit.bench optim --params 104857600 --tensors 50
step 60 "bench optim, 20M params in 2000 tensors" python -m onebit.bench optim --params 20971520 --tensors 2000
if [ "${PROFILES:-0}" = 1 ]; then
  step 45 "step profile, 100M params in 50 tensors" python -m benchmarks.step_profile --params 104857600 --tensors 50
  step 60 "step profile, 20M params in 2000 tensors" python -m benchmarks.step_profile --params 20971520 --tensors 2000 --top 4
  step 60 "host time: the step's ops one by one, and its Python profile" python -m benchmarks.host_time --top 8
fi
RANKS="tests/gpu/test_gpu_ranks.py tests/optim/test_sharded.py"  # the multi-rank GPU tests
step 90 "pytest -m gpu, one process" python -m pytest -q -rs -m gpu tests -p no:cacheprovider \
  --tb=short --durations=8 $(for f in $RANKS; do echo "--ignore=$f"; done)
# NCCL_DEBUG=WARN: a failing rank's output (which the test prints) carries NCCL's reason.
# -v: each test's verdict as it ends, kept if the deadline cuts the step short.
step 300 "pytest -m gpu, several ranks over NCCL (2, 3 and 4 ranks)" env NCCL_DEBUG=WARN \
  python -m pytest -v -rs -m gpu $RANKS -p no:cacheprovider --tb=short --durations=20
git log -1 --format='=== at commit %h (%s) ===' 2>/dev/null
