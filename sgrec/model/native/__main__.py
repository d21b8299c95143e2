"""`python -m sgrec.model.native`: builds sgrec's CPU kernels now (else the first server does) and
prints where the library is, or why it could not be built."""

import logging
import sys

from sgrec.model import native

logging.basicConfig(level=logging.INFO, format="%(message)s")
if native.load() is None:
    sys.exit(1)
print(native._state["path"])
