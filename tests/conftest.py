# tests/mpi/ only makes sense under mpirun; backends/test_mpirun.py launches it there.
from onebit.launch import under_mpirun

_UNDER_MPI = under_mpirun()
collect_ignore = [] if _UNDER_MPI else ["mpi"]
