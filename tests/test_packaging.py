"""The package as a user installs it: a wheel built from this tree (``pip wheel .``),
installed into a fresh virtual environment, imported from elsewhere with its compiled
extension, and carrying its licence in the metadata.

The fresh environment borrows torch, numpy and Horovod from the test's own through a
``.pth`` file (so nothing is downloaded) and gets ssfusion-hvd from the wheel alone;
the wheel is built without isolation against the installed torch, as
``scripts/install.sh`` builds, reusing the incremental CMake tree under ``build/``.
"""
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(900)
def test_wheel_installs_into_a_fresh_venv_and_imports_the_extension(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                    "-q", str(REPO), "-w", str(wheels)], check=True, cwd=REPO)
    (wheel,) = wheels.glob("ssfusion_hvd-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    probe = ("import ssfusion_hvd, torch\n"
             "from ssfusion_hvd import _C, ops\n"
             "v, i = ops.topk(torch.tensor([3., -9., 1., 4.]), 2)\n"
             "print(ssfusion_hvd.__file__); print(_C.__file__); print(sorted(i.tolist()))\n")
    out = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True,
                         cwd=tmp_path).stdout.splitlines()
    assert out[0].startswith(site) and out[1].startswith(site), out  # the wheel's, not the tree's
    assert out[2] == "[1, 3]"
    meta = subprocess.run([str(python), "-m", "pip", "show", "ssfusion-hvd"], check=True,
                          capture_output=True, text=True).stdout
    assert "License: Apache-2.0" in meta
    assert Path(site, f"ssfusion_hvd-{ssfusion_version()}.dist-info", "licenses", "LICENSE").is_file()


def ssfusion_version():
    import ssfusion_hvd
    return ssfusion_hvd.__version__
