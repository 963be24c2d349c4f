#!/usr/bin/env bash
# Reproduce every table of docs/benchmarks.md, in order, on this machine, from the
# repository root with the [bench] extra installed. Shaped-link tables need root.
set -euo pipefail
python -m onebit.bench -n 10                  # compressed allreduce vs dist.all_reduce, 4 local ranks
python -m onebit.bench kernels -n 7           # packbits / unpackbits / fused kernel vs numpy, clone, copy
python -m onebit.bench optim                  # optimizer step vs torch.optim.Adam(foreach), 10M params
python -m benchmarks.lm --steps 240 --batch 8 --every 40 --plot docs/lm_convergence.png  # tiny GPT, 3 seeds
python -m benchmarks.lm --steps 240 --batch 8 --every 40 --only OnebitLamb --lamb-lr-scale 10  # LAMB at 10x
python -m benchmarks.lm --steps 240 --batch 8 --every 40 --schedule constant  # the constant-lr gaps
for bs in "64 bfloat16" "128 bfloat16" "256 bfloat16" "256 float32" "1024 float32" "65536 float32"; do
  set -- $bs                                  # the block_size / scale dtype sweep (OnebitAdam, seed 0)
  python -m benchmarks.lm --steps 240 --batch 8 --every 240 --only OnebitAdam --seeds 0 \
    --block-size "$1" --scale-dtype "$2"
done
python -m benchmarks.convergence --steps 1000   # 1-bit optimizers vs baselines on digits
for backend in compressed hierarchical; do        # flat vs hierarchical (2 simulated nodes of 2)
  python -m benchmarks.lm --steps 240 --batch 8 --every 40 --backend $backend --ranks-per-node 2
done
python -m benchmarks.error_norm                   # docs/error_norm.png
# Shaped links (root; 4 network namespaces on this machine, egress shaped by tbf). One thread
# per rank: the "hosts" share this machine's 2 cores, which LOCAL_WORLD_SIZE=1 does not say.
if [ "$(id -u)" = 0 ] && [ -x benchmarks/shaped_net.sh ]; then
  for rate in 100mbit 1gbit; do
    for piece in 0 2M auto; do                # the pipelining table
      benchmarks/shaped_net.sh run 4 $rate -- .venv/bin/python -m onebit.bench -b 64M -e 64M \
        -w 1 -n 3 --piece-size $piece
    done
  done
  for rate in 100mbit 1gbit; do              # multi-node: 2 hosts x 2 ranks, flat vs hierarchical
    PER_HOST=2 benchmarks/shaped_net.sh run 2 $rate -- .venv/bin/python -m onebit.bench \
      -b 64M -e 64M -w 1 -n 5 --backend compressed,hierarchical
  done
  for rate in none 1gbit 100mbit; do         # the probe's prediction against the measured saving
    benchmarks/shaped_net.sh run 4 $rate -- .venv/bin/python -m onebit.bench probe --verify
  done
  OMP_NUM_THREADS=1 benchmarks/shaped_net.sh run 4 1gbit -- .venv/bin/python -m onebit.bench step
  OMP_NUM_THREADS=1 benchmarks/shaped_net.sh run 4 100mbit -- .venv/bin/python -m onebit.bench step \
    --steps 5 --untimed 8
fi
