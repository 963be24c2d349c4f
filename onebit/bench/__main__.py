"""python -m onebit.bench [allreduce|kernels|optim] ...  (allreduce is the default)."""
from __future__ import annotations

import argparse
import sys

from . import kernels

COMMANDS = {"kernels": kernels}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in COMMANDS else "kernels"
    module = COMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"python -m onebit.bench {name}",
                                     description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    return int(bool(module.run(parser.parse_args(argv)) is False))


if __name__ == "__main__":
    sys.exit(main())
