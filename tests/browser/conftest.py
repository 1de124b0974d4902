"""Fixtures for the browser test: a JupyterLab server on localhost over a copy of the notebooks, and Debian's
Chromium driven by Python playwright.

The test is opt-in (marker ``browser``): a plain ``python -m pytest`` skips it at once, without starting anything.
Run it with

    python -m pytest -m browser tests/browser

(or set ``K2LAB_BROWSER=1``). Without playwright or a Chromium it skips with the reason; it never fails for lack
of a browser. Environment:

    K2LAB_CHROMIUM          the Chromium executable (default: /usr/bin/chromium, else chromium on PATH)
    K2LAB_ARTIFACTS         where screenshots, reports and the server log go (default: tests/browser/artifacts/)
    K2LAB_BROWSER_TIMEOUT   seconds one notebook may take to run all its cells (default: 900; the CI CPU is slow)
    K2LAB_LAB_START_TIMEOUT seconds JupyterLab may take to answer (default: 300)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"

# Debian's Chromium, started for a headless CI container: no sandbox (CI runs as root), no GPU, and none of the
# background traffic (component updates, sync, safe-browsing lists) that a closed network refuses many times a second.
# Playwright gives every launch a new empty profile itself (it refuses a --user-data-dir argument).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",  # small /dev/shm in containers
]

# User settings for the temporary lab (stored in a temporary settings folder, never the user's own):
LAB_SETTINGS = {
    # Never ask about, nor fetch, Jupyter news or updates: the toast would cover the notebook and the fetch
    # would fail without a network.
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
    # Attach every cell to the page ('none'), so the test sees all outputs and one tall screenshot shows them;
    # the default ('contentVisibility') lets the browser skip drawing cells out of view.
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "browser: runs the notebooks in JupyterLab in a headless Chromium (opt-in: -m browser)")


def _opted_in(config: pytest.Config) -> bool:
    return "browser" in (config.getoption("markexpr") or "") or os.environ.get("K2LAB_BROWSER", "") not in ("", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _opted_in(config):
        return
    skip = pytest.mark.skip(reason="browser test is opt-in: python -m pytest -m browser tests/browser")
    for item in items:
        if item.get_closest_marker("browser"):
            item.add_marker(skip)


# ---------------------------------------------------------------------------------------------------------------------
# Where the artifacts go


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """A folder for screenshots and reports, kept after the run (git-ignored by a ``.gitignore`` written into it)."""
    folder = Path(os.environ.get("K2LAB_ARTIFACTS") or ARTIFACTS)
    folder.mkdir(parents=True, exist_ok=True)
    if folder == ARTIFACTS:
        (folder / ".gitignore").write_text("# written by tests/browser/conftest.py: screenshots are not committed\n*\n")
    return folder


# ---------------------------------------------------------------------------------------------------------------------
# The browser


def _chromium_path() -> str | None:
    wanted = os.environ.get("K2LAB_CHROMIUM")
    if wanted:
        return wanted if os.access(wanted, os.X_OK) else None
    for candidate in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="session")
def chromium() -> Iterator[object]:
    """A headless Chromium (a playwright ``Browser``); skips when playwright or the executable is missing."""
    try:
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; its own browser download is not needed)")
    executable = _chromium_path()
    if executable is None:
        pytest.skip("no Chromium: install Debian's (apt-get install chromium) or set K2LAB_CHROMIUM")
    with sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        except PlaywrightError as err:
            # A browser that cannot start here (not executable, missing libraries) is no browser; any other error
            # (a bad launch option, say) is the test's own and fails.
            if not re.search(r"Failed to launch|doesn't exist|error while loading shared libraries", str(err)):
                raise
            pytest.skip(f"{executable} did not start under playwright: {str(err).splitlines()[0]}")
        try:
            yield browser
        finally:
            browser.close()


# ---------------------------------------------------------------------------------------------------------------------
# The lab


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; elsewhere none), so kernels left behind can be ended by id."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                children = [int(c) for c in (task / "children").read_text().split()]
                found += children
                todo += children
    return found


def _stop(server: subprocess.Popen) -> None:
    """Stop the server (on SIGTERM it shuts its kernels down), harder if it hangs; end any kernel left, by its id."""
    if server.poll() is not None:
        return
    kernels = _descendants(server.pid)
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        server.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(wait)
            break
    for pid in kernels:
        with contextlib.suppress(OSError):  # gone already (or its id reused by something that is not a kernel)
            if b"kernel" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


class Lab:
    """A running JupyterLab: ``url``, its root folder and its log."""

    def __init__(self, url: str, root: Path, log: Path):
        self.url, self.root, self.log = url, root, log

    def log_tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


@pytest.fixture(scope="session")
def lab(chromium: object, tmp_path_factory: pytest.TempPathFactory, artifacts: Path) -> Iterator[Lab]:
    """JupyterLab on a free localhost port over a temporary copy of notebooks/, no token, no password, no browser of
    its own; always stopped at the end. (Asks for ``chromium`` first, so a missing browser skips before it starts.)"""
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        pytest.skip("jupyterlab is not installed (pip install -e '.[lab]')")
    top = tmp_path_factory.mktemp("lab")
    root, config, settings, workspaces, runtime = (top / name for name in
                                                   ("root", "config", "settings", "workspaces", "runtime"))
    root.mkdir()
    for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):  # the notebooks find k2lab (editable) and its assets by import
        shutil.copy2(notebook, root / notebook.name)
    for name, values in LAB_SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    config.mkdir()
    # A private config folder, so the user's jupyter_server_config cannot change what is tested; the news feed off.
    (config / "jupyter_server_config.json").write_text(json.dumps({"LabApp": {"news_url": None}}))

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("K2LAB_")}  # the notebooks load K2-nano
    env.update(JUPYTER_CONFIG_DIR=str(config), JUPYTER_RUNTIME_DIR=str(runtime), HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")  # as scripts/build_notebooks.py runs them: the CPU is shared
    command = [
        sys.executable, "-m", "jupyterlab",
        "--no-browser", "--ServerApp.open_browser=False",
        "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
        f"--ServerApp.root_dir={root}",
        "--IdentityProvider.token=", "--ServerApp.password=",
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run commands the way the menus do
        f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={workspaces}",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []),  # CI containers run as root
    ]
    log = artifacts / "jupyterlab.log"
    with log.open("w") as out:
        server = subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    running = Lab(base, root, log)
    try:
        deadline = time.monotonic() + float(os.environ.get("K2LAB_LAB_START_TIMEOUT", 300))
        while not _answers(f"{base}/api/status"):
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited with {server.returncode}:\n{running.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer on {base} in time:\n{running.log_tail()}")
            time.sleep(1)
        yield running
    finally:
        _stop(server)
