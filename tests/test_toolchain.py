"""The build's toolchain guard (scripts/toolchain.py, CMakeLists.txt): a g++ that links
libstdc++ only statically is never used for _C. Such a build crashed on the GPU image (its
/opt/gcc g++ has only libstdc++.a) at the first error message that formats a number."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
from toolchain import (CANDIDATES, build_env, clear_stale_cache,  # noqa: E402
                       static_libstdcxx_only)

#: a g++ that links libstdc++ shared, as build_env would pick one
GXX = next((shutil.which(c) for c in CANDIDATES
            if shutil.which(c) and not static_libstdcxx_only(shutil.which(c))), None)
pytestmark = pytest.mark.skipif(GXX is None, reason="needs a g++ that links libstdc++ shared")


@pytest.fixture
def static_gxx(tmp_path):
    """A driver as the GPU image's g++: it finds libstdc++.a but no libstdc++.so (GCC then
    prints the bare name); everything else goes to the real g++. A gcc beside it."""
    path = tmp_path / "bin" / "g++"
    path.parent.mkdir()
    path.write_text("#!/bin/sh\nif [ \"$1\" = -print-file-name=libstdc++.so ]; then "
                    f"echo libstdc++.so; else exec {GXX} \"$@\"; fi\n")
    path.chmod(0o755)
    (path.parent / "gcc").symlink_to(path)
    return str(path)


def test_static_libstdcxx_only_tells_the_drivers_apart(static_gxx, tmp_path):
    assert static_libstdcxx_only(static_gxx)
    assert not static_libstdcxx_only(GXX)
    assert not static_libstdcxx_only(str(tmp_path / "missing"))  # cannot answer: left alone


def test_build_env_replaces_each_static_driver(static_gxx):
    path = os.environ["PATH"]
    gcc = next(str(Path(GXX).with_name(n)) for n in ("gcc", "cc") if Path(GXX).with_name(n).exists())
    good = {"CXX": GXX, "CUDAHOSTCXX": GXX, "CC": gcc, "PATH": path}  # whatever PATH holds
    assert build_env(good) == good
    assert build_env({"CXX": f"ccache {GXX}", "CUDAHOSTCXX": GXX, "CC": gcc, "PATH": path})["CXX"] \
        == f"ccache {GXX}"  # a launcher before the compiler: the compiler is judged
    env = build_env({"CXX": static_gxx, "CC": str(Path(static_gxx).with_name("gcc")),
                     "CUDAHOSTCXX": static_gxx, "PATH": path})
    assert env["CXX"] == GXX and env["CUDAHOSTCXX"] == GXX
    assert Path(env["CC"]).parent == Path(GXX).parent and Path(env["CC"]).name in ("gcc", "cc")
    # a good C++ compiler does not hide a static nvcc host compiler
    env = build_env({"CXX": GXX, "CUDAHOSTCXX": static_gxx, "CC": gcc, "PATH": path})
    assert env["CXX"] == GXX and env["CUDAHOSTCXX"] == GXX
    with pytest.raises(RuntimeError, match="links libstdc\\+\\+ only statically"):
        build_env({"CXX": static_gxx, "PATH": path}, candidates=(static_gxx,))


def test_a_build_tree_configured_with_another_compiler_is_reconfigured(tmp_path, static_gxx):
    cache = tmp_path / "CMakeCache.txt"
    # a compiler no machine has (the lent GPU machines do have a static-only /opt/gcc/bin/g++)
    cache.write_text(f"CMAKE_CXX_COMPILER:FILEPATH={tmp_path}/elsewhere/bin/g++\n")
    assert not clear_stale_cache(tmp_path, {})  # nothing named, nothing known to be wrong
    assert clear_stale_cache(tmp_path, {"CXX": GXX}) and not cache.exists()
    cache.write_text(f"CMAKE_CXX_COMPILER:FILEPATH={GXX}\n")
    assert not clear_stale_cache(tmp_path, {"CXX": GXX}) and cache.exists()
    # a static-only compiler in the cache goes, named in the environment or not
    cache.write_text(f"CMAKE_CXX_COMPILER:FILEPATH={static_gxx}\n")
    assert clear_stale_cache(tmp_path, {}) and not cache.exists()
    # and so does an nvcc host compiler other than CUDAHOSTCXX names
    cache.write_text(f"CMAKE_CXX_COMPILER:FILEPATH={GXX}\n"
                     f"CMAKE_CUDA_HOST_COMPILER:UNINITIALIZED={static_gxx}\n")
    assert clear_stale_cache(tmp_path, {"CXX": GXX, "CUDAHOSTCXX": GXX})


def test_cmake_refuses_a_static_libstdcxx_compiler(static_gxx, tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("needs cmake")
    proc = subprocess.run(["cmake", "-S", str(REPO), "-B", str(tmp_path / "build"),
                           f"-DCMAKE_CXX_COMPILER={static_gxx}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "links libstdc++ only statically" in " ".join((proc.stdout + proc.stderr).split())


def test_the_extension_links_libstdcxx_shared():
    """The guard's point, on the built module itself."""
    from ssfusion_hvd import ops

    if not ops.have_extension() or shutil.which("readelf") is None:
        pytest.skip("needs the extension and readelf")
    out = subprocess.run(["readelf", "-d", ops._C.__file__], capture_output=True, text=True,
                         check=True).stdout
    assert "libstdc++.so" in out, out
