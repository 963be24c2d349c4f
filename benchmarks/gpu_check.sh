#!/usr/bin/env bash
# One run on a machine with a GPU, for whoever holds one: install the
# checkout, run the kernel and optimizer-step benches and the step's
# profile, then the GPU test tier, each under its own deadline (about 8
# minutes in all), printing every figure. Ranks share the GPU through cuda:gloo groups where NCCL
# would refuse two ranks on one device.
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
step 45 "step profile, 100M params in 50 tensors" python -m benchmarks.step_profile --params 104857600 --tensors 50
step 60 "step profile, 20M params in 2000 tensors" python -m benchmarks.step_profile --params 20971520 --tensors 2000 --top 4
step 60 "host time: the step's ops one by one, and its Python profile" python -m benchmarks.host_time --top 8
step 300 "pytest -m gpu" python -m pytest -q -rs -m gpu tests -p no:cacheprovider --tb=short --durations=12
