"""scripts/run_notebooks.py runs each notebook source as a script with K2LAB_DEVICE_MAP set and reports each one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run_notebooks.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_each_source_runs_with_the_device_set_and_a_failure_is_named(tmp_path):
    sources = tmp_path / "notebooks" / "src"
    sources.mkdir(parents=True)
    (sources / "01_reads_the_device.py").write_text(
        "import os, pathlib\nassert os.environ['K2LAB_DEVICE_MAP'] == 'cuda:1'\n"
        "assert pathlib.Path.cwd().name == 'notebooks'\nimport k2lab\n")
    (sources / "02_breaks.py").write_text("raise RuntimeError('Expected all tensors to be on the same device')\n")
    (sources / "helper.py").write_text("raise SystemExit('not a notebook: never run')\n")
    done = run("--device", "cuda:1", "--sources", str(sources), "--log-dir", str(tmp_path / "logs"))
    lines = done.stdout.splitlines()
    assert done.returncode == 1 and lines[0] == "K2LAB_DEVICE_MAP=cuda:1"
    assert lines[1].startswith("ok   01_reads_the_device")
    assert lines[2].startswith("FAIL 02_breaks") and "RuntimeError: Expected all tensors" in lines[2]
    assert lines[-1] == "1 passed, 1 failed"
    assert "Traceback" in (tmp_path / "logs" / "02_breaks.log").read_text()
    assert run("--device", "cuda:1", "--sources", str(sources), "01").returncode == 0  # the prefix leaves 02 out


def test_a_prefix_that_names_no_notebook_is_refused(tmp_path):
    done = run("--sources", str(tmp_path), "99")
    assert done.returncode == 2 and "no notebook source" in done.stderr
