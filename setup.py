"""Install onebit, compiling the CPU sign-bit kernel ahead of time.

`builders/` and `kernels/` are installed *inside* the package (as
`onebit.builders` and `onebit.kernels`) so nothing generic lands at the top of
site-packages, and so the just-in-time builder can find the sources after a
plain `pip install .`.
"""
import os
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


ext_modules = []
if os.environ.get("ONEBIT_NO_AOT", "0") in ("", "0"):
    ext_modules.append(
        Pybind11Extension(
            "onebit._packbits_cpu",
            ["kernels/cpu/packbits.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    )

setup(
    name="onebit",
    version="0.1.0",
    description="Communication-compressed 1-bit Adam, 1-bit LAMB and 0/1 Adam for PyTorch, on every accelerator",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["onebit", "onebit.*"]) + ["onebit.builders", "onebit.kernels"],
    package_dir={"onebit.builders": "builders", "onebit.kernels": "kernels"},
    package_data={"onebit.kernels": ["cpu/*.cpp", "cuda/*.cu", "sycl/*.cpp"],
                  "onebit.bench": ["data/*.txt.gz"]},
    include_package_data=True,
    # pybind11: headers for the just-in-time build; tqdm: the bench progress bar.
    install_requires=["torch>=2.1,<3", "numpy>=1.22", "pybind11>=2.10", "tqdm"],
    extras_require={
        "mpi": ["mpi4py>=3.1", "mpich>=4"],
        "cuda": ["cupy-cuda12x>=13"],
        "xpu": [],  # torch>=2.5 has torch.xpu natively; nothing more to install
        "dev": ["pytest>=7", "pytest-timeout>=2", "pybind11>=2.10", "scikit-learn",
                "transformers>=4.40", "accelerate>=0.26", "lightning>=2.2",
                "matplotlib"],  # examples and --plot run in the tests
        "bench": ["matplotlib", "scikit-learn"],
    },
    ext_modules=ext_modules,
    cmdclass={"build_ext": optional_build_ext},
    zip_safe=False,
)
