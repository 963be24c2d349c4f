import os
import sys

# Tests import their helpers (reference.py, distributed.py) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))

# tests/mpi/ only makes sense under mpirun; test_mpirun.py launches it there.
_UNDER_MPI = any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))
collect_ignore = [] if _UNDER_MPI else ["mpi"]
