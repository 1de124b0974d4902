"""The wheel a user installs: built from the source tree, under 30 MB, carrying K2-nano as package data, and
loading it offline from a fresh virtual environment in another folder (no source tree on the path) that holds the
core dependencies alone: no extra, so no numpy.

Marked slow: it builds the package and creates a virtual environment. The build runs on a copy of the tree (a
setuptools build writes build/ and *.egg-info next to the sources) and offline (no build isolation, no index)."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NANO = REPO / "k2lab" / "lab" / "assets" / "nano"
# What the fresh environment must not see of this one: numpy, which only the lab extra brings, and k2lab itself (the
# environment gets the wheel). Matched on a site-packages entry's name up to its first "-" or ".": the package,
# its dist-info and numpy's bundled libraries (numpy.libs).
LEFT_OUT = {"numpy", "k2lab"}

pytestmark = pytest.mark.slow


def _run(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(REPO / "k2lab", source / "k2lab", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", tmp / "dist", source)
    (built,) = (tmp / "dist").glob("k2lab-*.whl")
    return built


def test_wheel_is_small_and_carries_k2_nano(wheel):
    assert wheel.stat().st_size < 30e6
    names = set(zipfile.ZipFile(wheel).namelist())
    bundled = {f"k2lab/lab/assets/nano/{f.name}" for f in NANO.iterdir()}
    assert "k2lab/lab/assets/nano/config.json" in bundled
    assert bundled <= names, sorted(bundled - names)
    assert {"k2lab/py.typed", "k2lab/lab/assets/README.md"} <= names


def _core_packages(into: Path) -> Path:
    """A folder of links to what this interpreter's site-packages hold, less LEFT_OUT: the core dependencies
    (torch, safetensors, ...) as installed here, since offline pip cannot fetch them for the fresh environment."""
    site_dirs = {*site.getsitepackages(), *(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))}
    if site.ENABLE_USER_SITE:
        site_dirs.add(site.getusersitepackages())
    chosen: dict[str, Path] = {}
    for folder in (Path(p) for p in sys.path if p in site_dirs and Path(p).is_dir()):
        for entry in sorted(folder.iterdir()):
            if re.split(r"[-.]", entry.name, maxsplit=1)[0].lower() not in LEFT_OUT:
                chosen.setdefault(entry.name, entry)  # the first site directory on sys.path wins, as in an import
    into.mkdir()
    for name, entry in chosen.items():
        (into / name).symlink_to(entry)
    return into


def test_installed_wheel_loads_k2_nano_and_generates_offline_without_numpy(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)  # no system site-packages: numpy may live there
    python = venv / "bin" / "python"
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    # A plain path line: the linked folder's own .pth files do not run, so an editable k2lab stays out.
    (purelib / "core_dependencies.pth").write_text(f"{_core_packages(tmp_path / 'core')}\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1", "PYTHONNOUSERSITE": "1"}
    code = (
        "import importlib.util\n"
        "assert importlib.util.find_spec('numpy') is None, 'numpy is importable: the check would prove nothing'\n"
        "import torch, k2lab\n"
        "model, tok = k2lab.load_nano()\n"
        "ids = torch.tensor([tok.encode('import ')])\n"
        "out = k2lab.generate(model, ids, max_new_tokens=3)\n"
        "print(k2lab.__file__)\n"
        "print(k2lab.__version__, model.config.vocab_size, tok.vocab_size, ids.shape[1], out.shape[1])\n"
    )
    done = _run(python, "-c", code, cwd=elsewhere, env=env)
    where, figures = done.stdout.splitlines()[-2:]
    assert Path(where).resolve().is_relative_to(purelib.resolve()), where  # the installed copy, not the tree
    assert not Path(where).resolve().is_relative_to(REPO)
    version, vocab, tok_vocab, prompt, generated = figures.split()
    assert version != "0.0.0+unknown"  # the installed distribution's metadata answers
    assert int(vocab) == int(tok_vocab) == 8192 and int(generated) == int(prompt) + 3
