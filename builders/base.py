"""What every op builder shares: where sources live, where builds go, and
how a compiler is run so that concurrent ranks never load a half-written file."""
from __future__ import annotations

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
    COMPILER_ENV = "ONEBIT_CXX"
    DEFAULT_COMPILER = "c++"

    def sources(self) -> List[Path]:
        paths = [kernels_dir() / s for s in self.SOURCES]
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            raise OpBuilderError(f"{self.NAME}: kernel sources missing: {missing}")
        return paths

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
        for p in self.sources():
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
            os.unlink(tmp)
            raise OpBuilderError(
                f"{self.NAME}: compiling failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
        os.replace(tmp, output)
        return output

    def load(self):
        raise NotImplementedError
