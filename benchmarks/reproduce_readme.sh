#!/usr/bin/env bash
# Reproduce every table in the README, in order, on this machine.
# Each is one subcommand of the same tool: python -m onebit.bench.
set -euo pipefail
python -m onebit.bench -n 10                  # compressed allreduce vs dist.all_reduce, 4 local ranks
python -m onebit.bench kernels -n 7           # packbits / unpackbits / fused kernel vs numpy, clone, copy
python -m onebit.bench optim                  # optimizer step vs torch.optim.Adam(foreach), 10M params
python -m onebit.bench convergence --steps 1000   # 1-bit optimizers vs baselines on digits
