"""The tiny test models, built by :mod:`kvctl.lab.models` (the project's model builders); this path stays for the
scripts and tests that run it by file name.

    python tests/engine/make_tiny_model.py OUT_DIR [--mla]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run by path: the repository root on sys.path for `kvctl`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvctl.lab.models import (  # noqa: E402,F401 - re-exported for the tests
    HEAD_DIM, HIDDEN, KV_HEADS, MLA_MODEL_NAME, MODEL_NAME, NUM_LAYERS, VOCAB, kv_bytes_per_token, main,
    make_shaped_model, make_tiny_model,
)

if __name__ == "__main__":
    sys.exit(main(sys.argv))
