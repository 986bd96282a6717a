"""Build of ssfusion_hvd: setuptools drives CMakeLists.txt for the ``ssfusion_hvd._C``
extension (pybind11 + libtorch, Ninja generator).

Install with ``bash scripts/install.sh`` (it builds Horovod first); by hand:
``pip install --no-build-isolation -e .`` inside an environment that has torch, pybind11
and ninja. The CMake build tree is kept under ``build/`` so rebuilds are incremental.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# scripts/toolchain.py (libstdc++ linked shared), loaded by path: scripts/ is no package
_spec = importlib.util.spec_from_file_location("toolchain", ROOT / "scripts" / "toolchain.py")
toolchain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(toolchain)
build_env, clear_stale_cache = toolchain.build_env, toolchain.clear_stale_cache


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import pybind11
        import torch

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        tag = f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}"
        build_dir = ROOT / "build" / f"cmake-{tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path};{pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('SSF_BUILD_TYPE', 'Release')}",
            f"-DSSF_TORCH_CUDA={'ON' if torch.version.cuda else 'OFF'}",
            # SSF_COMPILE_CUDA=0 skips csrc/cuda even when nvcc is found (CI never sets it)
            f"-DSSF_COMPILE_CUDA={'OFF' if os.environ.get('SSF_COMPILE_CUDA') == '0' else 'ON'}",
        ]
        env = build_env()
        clear_stale_cache(build_dir, env)
        if torch.version.cuda:
            # the kernels' GPU architectures: TORCH_CUDA_ARCH_LIST's, else those of the GPUs
            # this machine has (CMakeLists.txt's default, 90, where it has none)
            archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(".", "").replace("+PTX", "")
            if not archs.strip() and torch.cuda.is_available():
                archs = ";".join(sorted({"%d%d" % torch.cuda.get_device_capability(i)
                                         for i in range(torch.cuda.device_count())}))
            if archs.strip():
                args.append(f"-DSSF_CUDA_ARCHS={';'.join(archs.replace(';', ' ').split())}")
        ninja = shutil.which("ninja")
        try:
            import ninja as ninja_pkg  # the PyPI package ships a binary

            ninja = ninja or os.path.join(ninja_pkg.BIN_DIR, "ninja")
        except ImportError:
            pass
        if ninja:
            args += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        cmake = shutil.which("cmake") or "cmake"
        jobs = os.environ.get("SSF_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call([cmake, str(ROOT)] + args, cwd=build_dir, env=env)
        subprocess.check_call([cmake, "--build", ".", "-j", jobs], cwd=build_dir, env=env)


setup(
    name="ssfusion-hvd",
    version="0.1.0",
    description="Tensor fusion with selective sparsification for Horovod + PyTorch",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    packages=find_packages(include=["ssfusion_hvd", "ssfusion_hvd.*"]),
    ext_modules=[CMakeExtension("ssfusion_hvd._C")],
    cmdclass={"build_ext": CMakeBuild},
    # tested: Python 3.11 (CI) and 3.12 (the GPU machine); torch 2.x with Horovod 0.28.1
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy"],
    extras_require={"horovod": ["horovod==0.28.1"]},
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
    zip_safe=False,
)
