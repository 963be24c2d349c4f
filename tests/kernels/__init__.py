"""Sign-bit packing kernels, their loading, the fused multi-tensor passes
and the accelerator seam."""
