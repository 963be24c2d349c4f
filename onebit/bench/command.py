"""One benchmark module as a command line: its flags, its checks, its exit status.

Every benchmark module offers `add_arguments(parser)`, `run(args)` and, where
some flag combinations are wrong, `check_arguments(args)`. `python -m
onebit.bench NAME` and the checkout's research benchmarks (`python -m
benchmarks.lm`) both go through `main`, so their flags behave alike.
"""
from __future__ import annotations

import argparse
from types import ModuleType
from typing import List, Optional


def parser_for(module: ModuleType, prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    return parser


def parse(module: ModuleType, argv: List[str], prog: str) -> argparse.Namespace:
    """The flags as `run` gets them; a wrong combination exits with status 2 and the reason."""
    parser = parser_for(module, prog)
    args = parser.parse_args(argv)
    check = getattr(module, "check_arguments", None)
    if check is not None:
        try:
            check(args)
        except ValueError as exc:
            parser.error(str(exc))  # usage and the message on stderr, exit status 2
    return args


def main(module: ModuleType, argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    # Run with -m, a module is named __main__; its spec keeps the dotted name.
    name = module.__spec__.name if module.__spec__ is not None else module.__name__
    prog = prog or f"python -m {name}"
    return 0 if module.run(parse(module, argv, prog)) is not False else 1
