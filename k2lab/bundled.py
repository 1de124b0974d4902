"""Where the files k2lab ships as package data lie: the bundled K2-nano (checkpoint, tokenizer, training log) in
``k2lab/lab/assets/nano``. A room of its own so that the lab, which loads K2-nano, and training, which writes it and
trains with its tokenizer, both find it without one importing the other."""

from importlib import resources
from pathlib import Path

# Found through importlib.resources, so an installed wheel carries it as an editable checkout does, and from the
# top package: asking for k2lab.lab's files would import the lab.
NANO_DIR = Path(str(resources.files("k2lab") / "lab" / "assets" / "nano"))
