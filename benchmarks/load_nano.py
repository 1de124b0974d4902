"""How long K2-nano takes to load: ``import k2lab`` plus ``load_nano()`` in a fresh interpreter (what a notebook's
first cell pays), and ``load_nano()`` alone in a warm one. Medians of alternating rounds; a busy machine shows
up as a slower figure, which is why this is a benchmark and not a test.

    python -m benchmarks.load_nano
"""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks.timing import alternate

COLD = "import k2lab; k2lab.load_nano()"


def main() -> None:
    import k2lab

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    seconds = alternate({
        "import k2lab + load_nano(), fresh interpreter": lambda: subprocess.run(
            [sys.executable, "-c", COLD], check=True, env=env),
        "load_nano() alone, warm interpreter": k2lab.load_nano,
    }, rounds=5)
    for name, s in seconds.items():
        print(f"{name}: {s:.2f} s")


if __name__ == "__main__":
    main()
