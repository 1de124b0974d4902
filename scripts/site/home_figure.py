"""The home page's figure, ``docs/assets/home/expert-share.png``, made from a figure the course stores: notebook 05's
share of held-out code and prose tokens per expert at K2-nano's last layer, as the notebook last ran it.

    python -m venv /tmp/figs && /tmp/figs/bin/pip install "kaleido==0.2.1" "plotly<6" numpy
    /tmp/figs/bin/python scripts/site/home_figure.py

(kaleido 0.2.1 brings its own renderer and works offline; plotly 6 and later refuse it, so it gets a venv of its own.)
Drawn at the width where every expert keeps its label, twice over for sharp screens. Rerun it when notebook 05's figure
changes; the site itself only copies the PNG.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "05_expert_load.ipynb"
TITLE = "share of each domain's tokens per expert"  # how the figure's title ends (its layer comes first)
OUT = REPO / "docs" / "assets" / "home" / "expert-share.png"
WIDTH, HEIGHT, SCALE = 640, 400, 2
PLOTLY = "application/vnd.plotly.v1+json"


def plain(value):
    """Plotly 6 stores arrays as {"dtype", "bdata", "shape"}; plotly 5 (kaleido 0.2.1's) reads plain lists."""
    if isinstance(value, dict):
        if "bdata" in value and "dtype" in value:
            import numpy as np

            array = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
            if "shape" in value:
                array = array.reshape([int(s) for s in str(value["shape"]).split(",")])
            return array.tolist()
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def stored_figure() -> dict:
    """The notebook's stored plotly figure whose title ends with ``TITLE``."""
    nb = json.loads(NOTEBOOK.read_text())
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            figure = output.get("data", {}).get(PLOTLY)
            if figure and figure.get("layout", {}).get("title", {}).get("text", "").endswith(TITLE):
                return figure
    raise SystemExit(f"{NOTEBOOK.relative_to(REPO)} stores no figure titled '... {TITLE}': run the notebook, or "
                     "choose the home page's figure anew")


def main() -> None:
    import plotly.io as pio

    figure = pio.from_json(json.dumps(plain(stored_figure())))
    figure.update_layout(width=WIDTH, height=HEIGHT)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    figure.write_image(str(OUT), width=WIDTH, height=HEIGHT, scale=SCALE)
    print(f"wrote {OUT.relative_to(REPO)}: {figure.layout.title.text}")


if __name__ == "__main__":
    main()
