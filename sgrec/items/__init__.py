"""BAT's item KV, shared by every user's rank requests: the store on one rank (`store.py`: hotness,
budget, pins), HRCS placement over ranks (`hrcs.py`, `python -m sgrec.items.hrcs`), item KV fetched
from the rank that owns it (`fetch.py`, ZMQ) and the pool across servers (`peers.py`). It uses the
item-as-prefix positions of `sgrec.layout`; the rank executor above uses it."""
