"""python -m onebit.bench [allreduce|kernels|optim|probe|step] ...  (allreduce is the default).

The research benchmarks (language model, digits convergence, memory soak) run
from a checkout: `python -m benchmarks.lm`, `benchmarks.convergence`,
`benchmarks.soak`.
"""
from __future__ import annotations

import sys

from . import allreduce, kernels, optim, probe, step
from .command import main as run_module
from .command import parser_for

COMMANDS = {"allreduce": allreduce, "kernels": kernels, "optim": optim, "probe": probe, "step": step}
DEFAULT = "allreduce"
RESEARCH = ("lm", "convergence", "soak")  # the checkout's benchmarks/


def usage() -> str:
    """The subcommands, each with its docstring's first line, then the default's flags."""
    lines = ["usage: python -m onebit.bench [SUBCOMMAND] [FLAGS]", "", "subcommands:"]
    for name, module in COMMANDS.items():
        summary = (module.__doc__ or "").strip().splitlines()[0].split(": ", 1)[-1]
        lines.append(f"  {name:<10} {summary}{' (the default)' if name == DEFAULT else ''}")
    lines += ["", "`python -m onebit.bench SUBCOMMAND --help` lists a subcommand's flags.",
              f"With no subcommand, {DEFAULT} runs; its flags:", ""]
    return "\n".join(lines) + parser_for(COMMANDS[DEFAULT], f"python -m onebit.bench {DEFAULT}").format_help()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        moved = (f"; the research benchmark {argv[0]} runs from a checkout: python -m "
                 f"benchmarks.{argv[0]}" if argv[0] in RESEARCH else "")
        print(f"python -m onebit.bench: unknown subcommand {argv[0]!r}; choose one of "
              f"{', '.join(COMMANDS)} (or none, for {DEFAULT}){moved}", file=sys.stderr)
        return 2
    name = argv.pop(0) if argv and argv[0] in COMMANDS else DEFAULT
    return run_module(COMMANDS[name], argv, prog=f"python -m onebit.bench {name}")


if __name__ == "__main__":
    sys.exit(main())
