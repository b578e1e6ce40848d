"""The source distribution (what `python -m build` and an index install from): it must hold every file
the extension's build reads, whichever kernels the machine that makes it builds."""
import os
import re
import shutil
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tracked(*paths):
    return subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


def test_the_source_distribution_holds_every_cpp_and_cuda_file(tmp_path):
    # a copy of the tracked files the build reads, so that the build's own files stay out of the checkout
    for path in _tracked("setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "csrc", "ms_loss_cuda",
                         "triton_kernels"):
        os.makedirs(tmp_path / "src" / os.path.dirname(path), exist_ok=True)
        shutil.copyfile(os.path.join(ROOT, path), tmp_path / "src" / path)
    # the PEP 517 hook that pip and `python -m build` call, on a machine that builds for CPU alone
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    made = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dist")], cwd=tmp_path / "src",
                          capture_output=True, text=True, env={**os.environ, "FORCE_ONLY_CPU": "1"})
    assert made.returncode == 0, made.stderr[-3000:]
    with tarfile.open(tmp_path / "dist" / made.stdout.split()[-1]) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    csrc = _tracked("csrc")
    assert any(path.endswith(".h") for path in csrc) and any(path.endswith(".cu") for path in csrc)
    assert set(csrc) <= names, sorted(set(csrc) - names)
    # every header a source includes by a relative name is there
    for path in csrc:
        with open(os.path.join(ROOT, path)) as handle:
            for header in re.findall(r'#include "([^"]+)"', handle.read()):
                assert os.path.normpath(os.path.join(os.path.dirname(path), header)) in names or \
                    os.path.join("csrc", header) in names, (path, header)
    assert {"setup.py", "pyproject.toml", "README.md", "ms_loss_cuda/loss.py", "triton_kernels/op.py"} <= names
    assert not any(name.startswith("tests/") for name in names)
