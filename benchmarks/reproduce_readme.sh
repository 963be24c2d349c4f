#!/usr/bin/env bash
# Reproduce every table in the README, in order, on this machine.
# Each is one subcommand of the same tool: python -m onebit.bench.
set -euo pipefail
python -m onebit.bench -n 10                  # compressed allreduce vs dist.all_reduce, 4 local ranks
python -m onebit.bench kernels -n 7           # packbits / unpackbits / fused kernel vs numpy, clone, copy
python -m onebit.bench optim                  # optimizer step vs torch.optim.Adam(foreach), 10M params
python -m onebit.bench lm --steps 240 --batch 8 --every 40 --plot docs/lm_convergence.png  # tiny GPT, 3 seeds
python -m onebit.bench lm --steps 240 --batch 8 --every 40 --only OnebitLamb --lamb-lr-scale 10  # LAMB at 10x
python -m onebit.bench lm --steps 240 --batch 8 --every 40 --schedule constant  # the constant-lr gaps
for bs in "64 bfloat16" "128 bfloat16" "256 bfloat16" "256 float32" "1024 float32" "65536 float32"; do
  set -- $bs                                  # the block_size / scale dtype sweep (OnebitAdam, seed 0)
  python -m onebit.bench lm --steps 240 --batch 8 --every 240 --only OnebitAdam --seeds 0 \
    --block-size "$1" --scale-dtype "$2"
done
python -m onebit.bench convergence --steps 1000   # 1-bit optimizers vs baselines on digits
