"""Fixed-column tables in the nccl-tests style: easy to paste and to diff."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence, TextIO


class Table:
    """Print a header once, then one row per call, in fixed-width columns."""

    def __init__(self, columns: Sequence[tuple], out: TextIO = sys.stdout,
                 quiet: bool = False) -> None:
        self.columns = list(columns)  # (name, width, format)
        self.out, self.quiet = out, quiet  # quiet: ranks other than 0 print nothing

    def header(self) -> None:
        if not self.quiet:
            self._print("#" + " ".join(f"{n:>{w}}" for n, w, _ in self.columns))

    def row(self, **values) -> None:
        if self.quiet:
            return
        cells = []
        for name, width, fmt in self.columns:
            v = values.get(name, "")
            cells.append(f"{(format(v, fmt) if v != '' else ''):>{width}}")
        self._print(" " + " ".join(cells))

    def _print(self, line: str) -> None:
        # Through tqdm when it is there: a live progress bar is cleared first and
        # redrawn below the row, so the two never share a line on a terminal.
        try:
            from tqdm import tqdm
        except ImportError:
            print(line, file=self.out, flush=True)
            return
        tqdm.write(line, file=self.out)
        self.out.flush()


def parse_size(text: str) -> int:
    """'1M' -> 1048576, '64K' -> 65536, '4KB' / '4KiB' -> 4096, '512' -> 512
    (bytes, nccl-tests style). Raises ValueError for anything else."""
    raw = text
    text = text.strip().upper()
    for suffix in ("IB", "B"):  # 4KiB, 4KB, 512B
        if text.endswith(suffix) and len(text) > len(suffix):
            text = text[:-len(suffix)]
            break
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    try:
        value = float(text[:-1] if mult > 1 else text)
    except ValueError:
        raise ValueError(f"not a size: {raw!r} (examples: 512, 64K, 4KB, 1M, 2G)") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"not a size: {raw!r} (examples: 512, 64K, 4KB, 1M, 2G)")
    return int(value * mult)


def size_arg(text: str) -> int:
    """argparse type: a payload size of at least one fp32 element (4 bytes)."""
    n = parse_size(text)
    if n < 4:
        raise argparse.ArgumentTypeError(f"{text!r} is below one fp32 element (4 bytes)")
    return n


def piece_arg(text: str):
    """argparse type: 'auto' (None) or a count of elements >= 0, with the
    size suffixes (2M = 2097152)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def count_arg(text: str) -> int:
    """argparse type: a count >= 1, with the size suffixes (25M = 25 * 2^20)."""
    try:
        n = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need at least 1")
    return n


def int_arg(minimum: int):
    """argparse type: an integer >= minimum."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {n}")
        return n
    parse.__name__ = f"integer >= {minimum}"
    return parse


def progress(total: int, desc: str):
    """A progress bar on stderr when stderr is a terminal and tqdm is
    installed; else nothing, so a log file (or a pipe that stdout shares)
    reads as the table alone."""
    try:
        from tqdm import tqdm

        if not sys.stderr.isatty():
            raise ImportError("stderr is not a terminal")
        return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
    except ImportError:
        class _Quiet:
            def update(self, n=1):
                pass

            def close(self):
                pass

        return _Quiet()
