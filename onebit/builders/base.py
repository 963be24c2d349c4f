"""What every op builder shares: where sources live, where builds go, and
how a compiler is run so that concurrent ranks never load a half-written file."""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Sequence


class OpBuilderError(RuntimeError):
    """A kernel could not be built or loaded; the message says why."""


def kernels_dir() -> Path:
    """The kernel sources, installed as the package `onebit.kernels`."""
    import onebit.kernels

    return Path(onebit.kernels.__file__).resolve().parent


class OpBuilder:
    """Base class. Subclasses set NAME and SOURCES and implement `load()`."""

    NAME = "PackbitsBuilder"
    SOURCES: Sequence[str] = ()
    # Included by every kernel source (what the kernels compute alike): part
    # of the hash, so a changed header rebuilds.
    HEADERS: Sequence[str] = ("common/onebit_kernels.h",)
    COMPILER_ENV = "ONEBIT_CXX"
    DEFAULT_COMPILER = "c++"

    def sources(self) -> List[Path]:
        paths = [kernels_dir() / s for s in self.SOURCES]
        missing = [str(p) for p in paths + self.headers() if not p.exists()]
        if missing:
            raise OpBuilderError(f"{self.NAME}: kernel sources missing: {missing}")
        return paths

    def headers(self) -> List[Path]:
        return [kernels_dir() / s for s in self.HEADERS]

    def compiler(self) -> str:
        """The compiler command: $ONEBIT_CXX (or the subclass's variable) or the default."""
        return os.environ.get(self.COMPILER_ENV, self.DEFAULT_COMPILER)

    def is_compatible(self) -> bool:
        """Whether the compiler exists (not whether the build will succeed)."""
        return shutil.which(self.compiler()) is not None

    def build_dir(self) -> Path:
        root = os.environ.get("ONEBIT_BUILD_DIR") or os.path.join(
            os.path.expanduser("~"), ".cache", "onebit")
        return Path(root)

    def source_hash(self) -> str:
        """Short hash of sources + interpreter, so a stale build is never loaded."""
        h = hashlib.sha256(sys.version.encode())
        for p in [*self.sources(), *self.headers()]:
            h.update(p.read_bytes())
        return h.hexdigest()[:12]

    def run_compiler(self, args: Sequence[str], output: Path) -> Path:
        """Compile into `output` atomically: build a temp file, then rename.

        Several ranks may build at once; each writes its own temp file and the
        last rename wins with identical content.
        """
        if not self.is_compatible():
            raise OpBuilderError(
                f"{self.NAME}: compiler {self.compiler()!r} not found "
                f"(set {self.COMPILER_ENV} to use another)")
        output.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=output.parent, suffix=output.suffix + ".tmp")
        os.close(fd)
        cmd = [self.compiler(), *args, "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            # nvcc deletes its own output when the link fails: a missing file
            # here must not hide the compiler's error below.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise OpBuilderError(
                f"{self.NAME}: compiling failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
        os.replace(tmp, output)
        return output

    def load(self):
        raise NotImplementedError


def self_test(kernels, device) -> None:
    """A tiny launch of `kernels` on `device`, checked against the wire
    format computed here in plain Python: raises OpBuilderError naming what
    went wrong. Run at load, so that a kernel that cannot run on this device
    (no machine code or PTX for it, a driver older than the runtime it was
    linked with) fails where the loader can still fall back, not at the first
    step of training."""
    import torch

    name = getattr(kernels, "name", type(kernels).__name__)
    values = [(-1.0) ** (i * i // 3) * (i + 1) for i in range(19)] + [-0.0]
    want = bytearray(3)
    for i, v in enumerate(values):
        want[i // 8] |= (v >= 0) << (i % 8)
    try:
        x = torch.tensor(values, dtype=torch.float32, device=device)
        bits = torch.empty(3, dtype=torch.uint8, device=device)
        kernels.pack(x, bits)
        out = torch.empty(len(values), dtype=torch.float32, device=device)
        kernels.decode(bits.view(1, -1), torch.full((1,), 0.5, device=device), 24, len(values),
                       out)
        got_bits, got = bytes(bits.cpu().tolist()), out.cpu().tolist()
    except Exception as exc:  # noqa: BLE001 - whatever the device says is the reason
        raise OpBuilderError(f"{name} kernels failed their self-test launch on {device}: "
                             f"{type(exc).__name__}: {exc}") from exc
    if got_bits != bytes(want):
        raise OpBuilderError(f"{name} kernels failed their self-test on {device}: packed "
                             f"{got_bits.hex()}, expected {bytes(want).hex()}")
    if got != [0.5 if v >= 0 else -0.5 for v in values]:
        raise OpBuilderError(f"{name} kernels failed their self-test on {device}: decoded "
                             f"{got}")
