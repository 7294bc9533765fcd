"""The package as a user installs it: ``python -m build`` makes an sdist and a wheel; the wheel
installs into a fresh virtualenv and ``gradwatch --version`` and ``import gradwatch`` work there.

The fresh environment gets the wheel without its dependencies, then every requirement the wheel
declares for the library and its ``cli`` extra except torch (a multi-GB download): the package
and its console script must work without importing torch until a watcher is built. The build
runs in pip's isolated build environment, fetching setuptools from the package index, as a
user's does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]



def _requirements(metadata: str, extra: str) -> list[str]:
    """The wheel's ``Requires-Dist`` of the library and of ``extra``, torch left out."""
    found = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        requirement, _, marker = line.removeprefix("Requires-Dist: ").partition(";")
        if marker and f'extra == "{extra}"' not in marker:
            continue
        if not re.match(r"torch\b", requirement.strip()):
            found.append(requirement.strip())
    return found


def _version() -> str:
    text = (ROOT / "src" / "gradwatch" / "version.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    assert match, "src/gradwatch/version.py defines no __version__"
    return match.group(1)


def _run(*args: str | Path, cwd: Path | None = None, timeout: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{args} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--outdir", out, ROOT, cwd=ROOT)
    return out


def test_build_names_the_distribution_and_version_from_one_place(dist_dir: Path) -> None:
    version = _version()
    wheels = list(dist_dir.glob("*.whl"))
    sdists = list(dist_dir.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"torch_gradwatch-{version}-py3-none-any.whl"]
    assert [s.name for s in sdists] == [f"torch_gradwatch-{version}.tar.gz"]
    with tarfile.open(sdists[0]) as sdist:
        assert f"torch_gradwatch-{version}/src/gradwatch/__init__.py" in sdist.getnames()


def test_wheel_ships_the_package_typed_and_nothing_else(dist_dir: Path) -> None:
    (wheel,) = dist_dir.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert top == {"gradwatch", f"torch_gradwatch-{_version()}.dist-info"}, top
    assert "gradwatch/py.typed" in names
    assert "gradwatch/export/metrics.py" in names and "gradwatch/cli/main.py" in names
    assert not [n for n in names if re.search(r"(^|/)(tests?|benchmarks|docs)/|\.png$", n)]
    metadata = zipfile.ZipFile(wheel).read(f"torch_gradwatch-{_version()}.dist-info/METADATA")
    assert b"Name: torch-gradwatch" in metadata
    entry_points = zipfile.ZipFile(wheel).read(
        f"torch_gradwatch-{_version()}.dist-info/entry_points.txt"
    ).decode()
    assert "gradwatch = gradwatch.cli.main:main" in entry_points


def test_wheel_installs_into_a_fresh_virtualenv(dist_dir: Path, tmp_path: Path) -> None:
    (wheel,) = dist_dir.glob("*.whl")
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    bin_dir = venv / "bin"
    _run(bin_dir / "pip", "install", "-q", "--no-deps", wheel)
    metadata = zipfile.ZipFile(wheel).read(f"torch_gradwatch-{_version()}.dist-info/METADATA")
    requirements = _requirements(metadata.decode(), "cli")
    assert any(r.startswith("typer") for r in requirements), requirements
    _run(bin_dir / "pip", "install", "-q", *requirements)
    assert _run(bin_dir / "gradwatch", "--version").strip() == f"gradwatch {_version()}"
    out = _run(
        bin_dir / "python",
        "-c",
        "import sys, gradwatch; print(gradwatch.__version__, gradwatch.__file__, "
        "'torch' in sys.modules)",
        cwd=tmp_path,
    ).split()
    assert out[0] == _version()
    assert out[1].startswith(str(venv)), "imported the checkout, not the installed wheel"
    assert out[2] == "False", "import gradwatch loaded torch"
