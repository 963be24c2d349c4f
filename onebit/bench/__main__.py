"""python -m onebit.bench [allreduce|kernels|lm|convergence|optim|probe|soak|step] ...  (allreduce is the default)."""
from __future__ import annotations

import argparse
import sys

from . import allreduce, convergence, kernels, lm, optim, probe, soak, step

COMMANDS = {"allreduce": allreduce, "kernels": kernels, "lm": lm, "convergence": convergence,
            "optim": optim, "probe": probe, "soak": soak, "step": step}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in COMMANDS else "allreduce"
    module = COMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"python -m onebit.bench {name}",
                                     description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    check = getattr(module, "check_arguments", None)
    if check is not None:
        try:
            check(args)
        except ValueError as exc:
            parser.error(str(exc))  # usage and the message on stderr, exit status 2
    return 0 if module.run(args) is not False else 1


if __name__ == "__main__":
    sys.exit(main())
