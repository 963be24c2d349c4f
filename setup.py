"""Install onebit, compiling the CPU sign-bit kernel ahead of time.

The kernel sources ship inside the package (`onebit/kernels`) so the
just-in-time builders find them after a plain `pip install .`. The version
lives in one place, `onebit/__init__.py`.
"""
import os
import re
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

# Builds must never fail the install: a missing compiler only costs speed, and
# onebit.ops falls back to its JIT builder and then to pure torch.
class optional_build_ext(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any toolchain failure
            print(f"onebit: CPU kernel not built ahead of time ({exc}); "
                  "it will be built just in time or fall back to torch", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"onebit: building {ext.name} failed ({exc})", file=sys.stderr)


def read_version() -> str:
    # Not `import onebit`: that needs torch, which the build environment lacks.
    text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "onebit", "__init__.py")).read()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


VERSION = read_version()
DOCS = ["mkdocs>=1.6,<2", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"]

ext_modules = []
if os.environ.get("ONEBIT_NO_AOT", "0") in ("", "0"):
    ext_modules.append(
        Pybind11Extension(
            "onebit._packbits_cpu",
            ["onebit/kernels/cpu/packbits.cpp"],
            depends=["onebit/kernels/common/onebit_kernels.h"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    )

setup(
    name="onebit",
    version=VERSION,
    description="Communication-compressed 1-bit Adam, 1-bit LAMB and 0/1 Adam for PyTorch, on every accelerator",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["onebit", "onebit.*"]),
    package_data={"onebit.kernels": ["cpu/*.cpp", "cuda/*.cu", "sycl/*.cpp", "common/*.h"]},
    include_package_data=True,
    # pybind11: headers for the just-in-time build; tqdm: the bench progress bar.
    install_requires=["torch>=2.1,<3", "numpy>=1.22", "pybind11>=2.10", "tqdm"],
    extras_require={
        "mpi": ["mpi4py>=3.1", "mpich>=4"],
        "cuda": ["cupy-cuda12x>=13"],
        "xpu": [],  # torch>=2.5 has torch.xpu natively; nothing more to install
        # onebit.fault_tolerance: replicas that fail and rejoin (wheels for Python 3.11)
        "ft": ["torchft>=0.2"],
        # examples and --plot run in the tests; the docs site is built there (--strict)
        "dev": ["pytest>=7", "pytest-timeout>=2", "pybind11>=2.10", "scikit-learn",
                "transformers>=4.40", "accelerate>=0.26", "lightning>=2.2",
                "matplotlib", *DOCS],
        "docs": DOCS,
        "bench": ["matplotlib", "scikit-learn"],  # the checkout's benchmarks/
    },
    ext_modules=ext_modules,
    cmdclass={"build_ext": optional_build_ext},
    zip_safe=False,
)
