"""The C++ toolchain setup.py hands to CMake: one that links libstdc++ as a shared library.

torch links the shared libstdc++. A g++ that links it statically (it finds no
``libstdc++.so``, only ``libstdc++.a``; the CUDA image of the GPU machines ships one as
/opt/gcc/bin/g++ and names it in CXX, CC and CUDAHOSTCXX) puts a second copy of the library
into ``_C``: two iostreams implementations then share streams and locales in one process,
and the first error message that formats a number (``TORCH_CHECK(..., "k=", k)``) crashes
with a segmentation fault instead of raising. CMakeLists.txt refuses such a compiler;
:func:`build_env` picks another one before CMake runs.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Dict, Optional

__all__ = ["links_shared_libstdcxx", "build_env"]


def links_shared_libstdcxx(cxx: str) -> bool:
    """Whether the C++ compiler driver ``cxx`` links libstdc++ as a shared library (it finds
    ``libstdc++.so``; GCC prints the bare name when it has none). A driver that cannot
    answer (not GCC-style, or missing) is left to CMake's own checks: True."""
    try:
        out = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True,
                             text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return True
    return os.path.isabs(out)


def _same(a: str, b: str) -> bool:
    return os.path.realpath(shutil.which(a) or a) == os.path.realpath(shutil.which(b) or b)


def build_env(environ: Optional[Dict[str, str]] = None,
              candidates=("g++", "c++", "/usr/bin/g++", "/usr/bin/c++")) -> Dict[str, str]:
    """The environment for CMake: ``environ`` (default ``os.environ``) unchanged when its
    C++ compiler (``CXX``, else ``c++``) links libstdc++ shared; else with ``CXX`` set to the
    first of ``candidates`` that does, ``CC`` to the ``gcc`` (or ``cc``) beside it and
    ``CUDAHOSTCXX`` to it unless that one links shared already. All three: CMake links
    ``_C`` with every enabled language's implicit library directories, and a static-only
    libstdc++ among them makes ``-lstdc++`` static again (setting only the C++ compiler
    was seen to keep the crash). Raises when no candidate will do."""
    env = dict(os.environ if environ is None else environ)
    chosen = env.get("CXX") or shutil.which("c++") or "c++"
    if links_shared_libstdcxx(chosen):
        return env
    for cand in candidates:
        path = shutil.which(cand) or cand
        if os.access(path, os.X_OK) and not _same(path, chosen) and links_shared_libstdcxx(path):
            break
    else:
        raise RuntimeError(f"{chosen} links libstdc++ statically (it finds no libstdc++.so) and "
                           "no other g++ was found: set CXX to a compiler that links it as a "
                           "shared library")
    print(f"[ssfusion_hvd] {chosen} links libstdc++ statically, which breaks _C beside torch's "
          f"shared libstdc++; building with {path} instead", file=sys.stderr)
    env["CXX"] = path
    host = env.get("CUDAHOSTCXX")
    if not host or not links_shared_libstdcxx(host):
        env["CUDAHOSTCXX"] = path
    for name in ("gcc", "cc"):
        cc = os.path.join(os.path.dirname(path), name)
        if os.access(cc, os.X_OK):
            env["CC"] = cc
            break
    return env
