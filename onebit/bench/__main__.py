"""python -m onebit.bench [allreduce|kernels|optim|probe|step] ...  (allreduce is the default).

The research benchmarks (language model, digits convergence, memory soak) run
from a checkout: `python -m benchmarks.lm`, `benchmarks.convergence`,
`benchmarks.soak`.
"""
from __future__ import annotations

import sys

from . import allreduce, kernels, optim, probe, step
from .command import main as run_module

COMMANDS = {"allreduce": allreduce, "kernels": kernels, "optim": optim, "probe": probe, "step": step}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in COMMANDS else "allreduce"
    return run_module(COMMANDS[name], argv, prog=f"python -m onebit.bench {name}")


if __name__ == "__main__":
    sys.exit(main())
