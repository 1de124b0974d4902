"""tests/weights/ reads the shared checkpoint helpers that live in tests/ (release_layout.py, hf_oracle.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
