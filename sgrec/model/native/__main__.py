"""`python -m sgrec.model.native`: builds sgrec's CPU kernels now (else the first server does) and
prints where the two libraries are (decode, then extend), or why they could not be built."""

import logging
import sys

from sgrec.model import native

logging.basicConfig(level=logging.INFO, format="%(message)s")
if native.load() is None or native.load_extend() is None:
    sys.exit(1)
print(native._state["path"])
print(native._state["extend_path"])
