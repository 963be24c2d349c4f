"""Kernel sources (C++, CUDA, SYCL), installed so op builders can compile them just in time."""
