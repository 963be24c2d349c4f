"""Where this rank runs, as the launcher tells it: how many ranks in all and
how many on this machine (torchrun, Open MPI, MPICH/Hydra). Plain
environment reads, so every layer may ask."""
from __future__ import annotations

import os

RANKS_PER_NODE_ENV = "ONEBIT_RANKS_PER_NODE"  # the explicit override, for unusual layouts

_WORLD_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")
_LOCAL_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def _first_int(names) -> int:
    for var in names:
        if os.environ.get(var, "").isdigit():
            return max(1, int(os.environ[var]))
    return 0


def world_size() -> int:
    """Ranks in the job, as the launcher tells it; 1 when it does not."""
    return _first_int(_WORLD_VARS) or 1


def world_size_variable() -> str:
    """The variable world_size() read (for messages), or WORLD_SIZE when none is set."""
    return next((v for v in _WORLD_VARS if os.environ.get(v, "").isdigit()), "WORLD_SIZE")


def local_world_size() -> int:
    """Ranks on this machine, as the launcher tells it; 1 when it does not."""
    return _first_int(_LOCAL_VARS) or 1


def ranks_per_node() -> int:
    """$ONEBIT_RANKS_PER_NODE when set, else the launcher's local world size."""
    return _first_int((RANKS_PER_NODE_ENV,)) or local_world_size()


def several_nodes_of_several_ranks() -> bool:
    """More than one node, and more than one rank on each: where the
    hierarchical allreduce pays (README, "Multi-node")."""
    k = ranks_per_node()
    return 1 < k < world_size()
