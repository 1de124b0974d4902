"""The wheel a user installs: built from the source tree, under 30 MB, carrying K2-nano as package data, and
loading it offline from a fresh virtual environment in another folder (no source tree on the path).

Marked slow: it builds the package and creates a virtual environment. The build runs on a copy of the tree (a
setuptools build writes build/ and *.egg-info next to the sources) and offline (no build isolation, no index)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NANO = REPO / "k2lab" / "lab" / "assets" / "nano"

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


def test_installed_wheel_loads_k2_nano_offline_from_another_folder(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    if sys.prefix != sys.base_prefix:
        # Run from inside a virtual environment (CI): --system-site-packages reaches the base interpreter's packages,
        # not this environment's torch. A plain path line adds them without running their .pth files, so an editable
        # k2lab of this environment stays out of the new one.
        outer = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
        (purelib / "outer_environment.pth").write_text("".join(f"{path}\n" for path in outer))
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    code = (
        "import torch, k2lab; model, tok = k2lab.load_nano(); ids = torch.tensor([tok.encode('import ')]); "
        "out = k2lab.generate(model, ids, max_new_tokens=3); "
        "print(k2lab.__file__); "
        "print(k2lab.__version__, model.config.vocab_size, tok.vocab_size, ids.shape[1], out.shape[1])"
    )
    done = _run(python, "-c", code, cwd=elsewhere, env=env)
    where, figures = done.stdout.splitlines()[-2:]
    assert Path(where).resolve().is_relative_to(purelib.resolve()), where  # the installed copy, not the tree
    assert not Path(where).resolve().is_relative_to(REPO)
    version, vocab, tok_vocab, prompt, generated = figures.split()
    assert version != "0.0.0+unknown"  # the installed distribution's metadata answers
    assert int(vocab) == int(tok_vocab) == 8192 and int(generated) == int(prompt) + 3
