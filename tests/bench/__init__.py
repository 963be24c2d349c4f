"""python -m onebit.bench and short versions of the benchmarks/ harness."""
