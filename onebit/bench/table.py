"""Fixed-column tables in the nccl-tests style: easy to paste and to diff."""
from __future__ import annotations

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
            print("#" + " ".join(f"{n:>{w}}" for n, w, _ in self.columns), file=self.out)

    def row(self, **values) -> None:
        if self.quiet:
            return
        cells = []
        for name, width, fmt in self.columns:
            v = values.get(name, "")
            cells.append(f"{(format(v, fmt) if v != '' else ''):>{width}}")
        print(" " + " ".join(cells), file=self.out, flush=True)


def parse_size(text: str) -> int:
    """'1M' -> 1048576, '64K' -> 65536, '512' -> 512 (bytes, nccl-tests style)."""
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def progress(total: int, desc: str):
    """A progress bar on stderr (tqdm when installed, else nothing)."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
    except ImportError:
        class _Quiet:
            def update(self, n=1):
                pass

            def close(self):
                pass

        return _Quiet()
