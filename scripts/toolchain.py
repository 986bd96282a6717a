"""The C++ toolchain setup.py hands to CMake: one that links libstdc++ as a shared library.

torch links the shared libstdc++. A g++ that can only link it statically (it finds
``libstdc++.a`` but no ``libstdc++.so``; the CUDA image of the GPU machines ships one as
/opt/gcc/bin/g++ and names it in CXX, CC and CUDAHOSTCXX) puts a second copy of the library
into ``_C``: two iostreams implementations then share streams and locales in one process,
and the first error message that formats a number (``TORCH_CHECK(..., "k=", k)``) crashes
with a segmentation fault instead of raising. CMakeLists.txt refuses such a compiler;
:func:`build_env` replaces it before CMake runs.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from typing import Dict, Optional

__all__ = ["static_libstdcxx_only", "build_env", "clear_stale_cache"]

#: where a replacement is looked for, in order
CANDIDATES = ("g++", "c++", "/usr/bin/g++", "/usr/bin/c++")


def _print_file_name(driver: str, name: str) -> str:
    try:
        return subprocess.run([driver, f"-print-file-name={name}"], capture_output=True,
                              text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def static_libstdcxx_only(driver: str) -> bool:
    """Whether the compiler driver ``driver`` finds ``libstdc++.a`` but no ``libstdc++.so``
    (a GCC-style driver prints the bare name of a library it does not find). Anything else,
    a clang with libc++ or a driver that cannot answer, is not judged here: False."""
    return (os.path.isabs(_print_file_name(driver, "libstdc++.a"))
            and not os.path.isabs(_print_file_name(driver, "libstdc++.so")))


def _driver(value: str) -> str:
    """The compiler program of a CXX-style value ("ccache g++" runs g++ through ccache:
    the program judged is the last word)."""
    words = shlex.split(value) or [value]
    return words[-1]


def _path(driver: str, path: Optional[str] = None) -> str:
    d = _driver(driver)
    return os.path.realpath(shutil.which(d, path=path) or d)


def build_env(environ: Optional[Dict[str, str]] = None,
              candidates=CANDIDATES) -> Dict[str, str]:
    """The environment for CMake: ``environ`` (default ``os.environ``) with each of ``CXX``
    (else ``c++``), ``CUDAHOSTCXX`` (else nvcc's ``g++``) and ``CC`` (else ``cc``) that
    links libstdc++ only statically replaced: the C++ compiler and nvcc's host compiler by
    the first of ``candidates`` that does not, the C compiler by the ``gcc`` (or ``cc``)
    beside it. On the GPU image, replacing the C++ compiler alone (by -D) kept the crash and
    replacing all three in the environment ended it; which of the other two mattered was
    not isolated (the link searches the CUDA toolchain's implicit library directories; C is
    not among the project's languages). Raises when one needs a replacement and no
    candidate will do."""
    env = dict(os.environ if environ is None else environ)
    search = env.get("PATH")
    bad = {}
    for var, default in (("CXX", "c++"), ("CUDAHOSTCXX", "g++"), ("CC", "cc")):
        found = shutil.which(_driver(env.get(var) or default), path=search)
        if found and static_libstdcxx_only(found):
            bad[var] = found
    if not bad:
        return env
    good = next((shutil.which(c, path=search) or c for c in candidates
                 if os.access(shutil.which(c, path=search) or c, os.X_OK)
                 and not static_libstdcxx_only(shutil.which(c, path=search) or c)), None)
    if good is None:
        raise RuntimeError(f"{', '.join(f'{v}={d}' for v, d in bad.items())}: links libstdc++ "
                           "only statically, and no other g++ was found; set CXX, CC and "
                           "CUDAHOSTCXX to compilers that link it as a shared library")
    for var, driver in bad.items():
        if var == "CC":
            sibling = next((os.path.join(os.path.dirname(good), n) for n in ("gcc", "cc")
                            if os.access(os.path.join(os.path.dirname(good), n), os.X_OK)), None)
            if sibling is None:
                continue
            env[var] = sibling
        else:
            env[var] = good
        print(f"[ssfusion_hvd] {var}: {driver} links libstdc++ only statically, which breaks "
              f"_C beside torch's shared libstdc++; using {env[var]}", file=sys.stderr)
    return env


def clear_stale_cache(build_dir, env: Dict[str, str]) -> bool:
    """Deletes ``build_dir``'s CMakeCache.txt when its C++ compiler or nvcc host compiler
    links libstdc++ only statically, or is another than ``env`` names in CXX / CUDAHOSTCXX:
    CMake reads those only on a first configure, so a tree configured with a static-only
    g++ would keep it (and fail CMakeLists.txt's check) whatever the environment says now.
    Returns whether it did."""
    cache = os.path.join(str(build_dir), "CMakeCache.txt")
    if not os.path.exists(cache):
        return False
    with open(cache) as f:
        entries = dict(line.rstrip("\n").split("=", 1) for line in f
                       if "=" in line and not line.startswith(("#", "//")))
    stale = False
    for entry, var in (("CMAKE_CXX_COMPILER", "CXX"), ("CMAKE_CUDA_HOST_COMPILER", "CUDAHOSTCXX")):
        cached = next((v for k, v in entries.items() if k.split(":")[0] == entry and v), None)
        if cached is None:
            continue
        if static_libstdcxx_only(cached) or (
                env.get(var) and _path(cached, env.get("PATH")) != _path(env[var], env.get("PATH"))):
            stale = True
    if stale:
        os.remove(cache)
    return stale
