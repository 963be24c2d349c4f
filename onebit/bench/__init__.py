"""`python -m onebit.bench`."""
