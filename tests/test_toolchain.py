"""The build's toolchain guard (scripts/toolchain.py, CMakeLists.txt): a g++ that links
libstdc++ statically is never used for _C. Such a build crashed on the GPU image (its
/opt/gcc g++ has only libstdc++.a) at the first error message that formats a number."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from toolchain import build_env, links_shared_libstdcxx  # noqa: E402

GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None or not links_shared_libstdcxx(GXX),
                                reason="needs a g++ that links libstdc++ shared")


@pytest.fixture
def static_gxx(tmp_path):
    """A g++ driver as the GPU image's: it finds no libstdc++.so (prints the bare name)."""
    path = tmp_path / "bin" / "g++"
    path.parent.mkdir()
    path.write_text("#!/bin/sh\ncase \"$1\" in -print-file-name=*) echo \"${1#-print-file-name=}\";;"
                    f" *) exec {GXX} \"$@\";; esac\n")
    path.chmod(0o755)
    (path.parent / "gcc").symlink_to(path)
    return str(path)


def test_links_shared_libstdcxx_tells_the_two_drivers_apart(static_gxx, tmp_path):
    assert links_shared_libstdcxx(GXX)
    assert not links_shared_libstdcxx(static_gxx)
    assert links_shared_libstdcxx(str(tmp_path / "missing"))  # left to CMake


def test_build_env_keeps_a_good_compiler_and_replaces_a_static_one(static_gxx):
    good = {"CXX": GXX, "PATH": os.environ["PATH"]}
    assert build_env(good) == good
    env = build_env({"CXX": static_gxx, "CC": static_gxx, "CUDAHOSTCXX": static_gxx,
                     "PATH": os.environ["PATH"]})
    assert env["CXX"] == GXX and env["CUDAHOSTCXX"] == GXX  # nvcc's host compiler as well
    assert Path(env["CC"]).parent == Path(GXX).parent  # and the C compiler beside it
    with pytest.raises(RuntimeError, match="links libstdc\\+\\+ statically"):
        build_env({"CXX": static_gxx}, candidates=(static_gxx,))


def test_cmake_refuses_a_static_libstdcxx_compiler(static_gxx, tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("needs cmake")
    proc = subprocess.run(["cmake", "-S", str(REPO), "-B", str(tmp_path / "build"),
                           f"-DCMAKE_CXX_COMPILER={static_gxx}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "links libstdc++ statically" in " ".join((proc.stdout + proc.stderr).split())
