"""The GPU tier: device kernels and NCCL ranks, and its launcher checked on the CPU."""
