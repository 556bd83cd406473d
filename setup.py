"""Builds the `_wsync` extension with CMake and packages it with python/wsync.

The build directory is $WSYNC_BUILD_DIR when set (an existing CMake build of this tree,
reused as it is: only the `_wsync` and `wsync_py_package` targets are built, and not even
those with WSYNC_BUILT=1, which packages what that directory already holds), else
build/pip under this tree, configured here for the interpreter running the install.
Parallel jobs: $CMAKE_BUILD_PARALLEL_LEVEL, else 2.
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


class BinaryDistribution(Distribution):
    """The wheel holds a compiled module: tag it for this platform and interpreter."""

    def has_ext_modules(self):
        return True


class BuildWithCMake(build_py):
    def run(self):
        super().run()
        build_dir = os.environ.get("WSYNC_BUILD_DIR")
        if build_dir:
            build_dir = os.path.abspath(build_dir)
            if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
                sys.exit(f"WSYNC_BUILD_DIR={build_dir} is not a configured CMake build directory")
        else:
            build_dir = os.path.join(ROOT, "build", "pip")
            subprocess.check_call(["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                                   f"-DWSYNC_PYTHON_EXECUTABLE={sys.executable}", "-DWSYNC_PYTHON=ON"])
        if not (os.environ.get("WSYNC_BUILT") == "1" and os.environ.get("WSYNC_BUILD_DIR")):
            jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")
            subprocess.check_call(["cmake", "--build", build_dir, "-j", jobs,
                                   "--target", "_wsync", "wsync_py_package"])
        built = glob.glob(os.path.join(build_dir, "python", "wsync", "_wsync*.so"))
        if not built:
            sys.exit(f"no _wsync*.so under {build_dir}/python/wsync after the CMake build")
        target = os.path.join(self.build_lib, "wsync")
        os.makedirs(target, exist_ok=True)
        for path in built:
            shutil.copy2(path, target)


# Keep setuptools' own scratch files out of the source tree and the CMake build.
SCRATCH = os.path.join(ROOT, "build", "setuptools")
os.makedirs(SCRATCH, exist_ok=True)

setup(
    packages=["wsync", "wsync.vllm"],
    package_dir={"": "python"},
    distclass=BinaryDistribution,
    cmdclass={"build_py": BuildWithCMake},
    options={"build": {"build_base": SCRATCH}, "egg_info": {"egg_base": SCRATCH}},
    zip_safe=False,
)
