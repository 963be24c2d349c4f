import os
import sys

# Tests import their helpers (reference.py, distributed.py) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))

# tests/mpi/ only makes sense under mpirun; test_mpirun.py launches it there.
from onebit.launch import under_mpirun  # noqa: E402

_UNDER_MPI = under_mpirun()
collect_ignore = [] if _UNDER_MPI else ["mpi"]
