"""Run every notebook's source as a script with the lab pointed at a device, and report each one's result.

    python scripts/run_notebooks.py --device cuda          # all of them, K2LAB_DEVICE_MAP=cuda
    python scripts/run_notebooks.py --device cpu 04 06     # those whose names start with 04 or 06

Each source (notebooks/src/NN_name.py, jupytext "percent" format) runs as a plain script in a fresh interpreter with
``K2LAB_DEVICE_MAP`` set, so that ``k2lab.lab.load_model`` puts the model there and every cell must follow it.
Figures are built but not shown. One line per notebook: ok or FAIL, its time, and for a failure the last line that
names an error (the whole tail goes to ``--log-dir``). The exit status is 1 when any notebook failed. This is the
check a GPU node runs (the CPU cannot hold a second device); nbval runs the notebooks themselves on the CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = REPO / "notebooks" / "src"


def run_one(source: Path, device: str, timeout: float) -> tuple[bool, float, str]:
    """(passed, seconds, output) of one notebook source run as a script from the folder above its own (the notebooks
    folder, where its relative paths point), with this checkout first on the path."""
    env = {**os.environ, "K2LAB_DEVICE_MAP": device, "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(source)], cwd=source.parent.parent, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return False, time.perf_counter() - start, out + f"\nTimeoutError: still running after {timeout:.0f} s"
    return done.returncode == 0, time.perf_counter() - start, done.stdout + done.stderr


def last_error(output: str) -> str:
    """The last line of the output that names an error, or its last line."""
    lines = [line for line in output.splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "error" in line]
    return (named or lines or ["(no output)"])[-1].strip()[:220]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixes", nargs="*", help="run only the notebooks whose names start with these")
    parser.add_argument("--device", default="cpu", help="K2LAB_DEVICE_MAP for every notebook (cpu, cuda, cuda:1, auto)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one notebook may take")
    parser.add_argument("--log-dir", type=Path, default=None, help="where each failure's output goes (default: none)")
    parser.add_argument("--sources", type=Path, default=SOURCES, help="the folder of notebook sources")
    args = parser.parse_args()
    sources = sorted(p for p in args.sources.glob("[0-9]*.py")
                     if not args.prefixes or p.stem.startswith(tuple(args.prefixes)))
    if not sources:
        parser.error(f"no notebook source in {args.sources} starts with {args.prefixes or 'a digit'}")
    failed = 0
    print(f"K2LAB_DEVICE_MAP={args.device}")
    for source in sources:
        passed, seconds, output = run_one(source, args.device, args.timeout)
        print(f"{'ok  ' if passed else 'FAIL'} {source.stem:<20} {seconds:6.1f} s" +
              ("" if passed else f"  {last_error(output)}"), flush=True)
        if not passed:
            failed += 1
            if args.log_dir is not None:
                args.log_dir.mkdir(parents=True, exist_ok=True)
                (args.log_dir / f"{source.stem}.log").write_text(output)
    print(f"{len(sources) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
