"""--hicache-storage-backend mooncake: the storage tier in Mooncake Store (a master plus the clients
that pool their memory; here over TCP). Every server pointed at the same master shares the pages: a
prefix one server computed is found by the others. Needs the mooncake-transfer-engine-non-cuda package
(`pip install "sgrec[mooncake]"`, and libibverbs1 from the OS) and a running `mooncake_master`.
"""

from __future__ import annotations

import os
import socket

# extra-config keys (SGLang's names) and their defaults; the environment names are SGLang's too
DEFAULTS = {
    "master_server_address": None,  # host:port of mooncake_master; $MOONCAKE_MASTER
    "metadata_server": "P2PHANDSHAKE",  # $MOONCAKE_TE_META_DATA_SERVER
    "global_segment_size": 4 << 30,  # bytes this server adds to the store (SGLang's 4 GiB); $MOONCAKE_GLOBAL_SEGMENT_SIZE
    "local_buffer_size": 64 << 20,  # the client's transfer buffer (at least one page)
    "protocol": "tcp",  # $MOONCAKE_PROTOCOL
    "local_hostname": "127.0.0.1",  # how the others reach this server's segment; $MOONCAKE_LOCAL_HOSTNAME
}
ENV = {"master_server_address": "MOONCAKE_MASTER", "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
       "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE", "protocol": "MOONCAKE_PROTOCOL",
       "local_hostname": "MOONCAKE_LOCAL_HOSTNAME"}
FLAG = "--hicache-storage-backend mooncake"


def settings(extra: dict) -> dict:
    out = {}
    for key, default in DEFAULTS.items():
        value = extra.get(key, os.environ.get(ENV[key]) if key in ENV else None)
        out[key] = default if value is None else value
    for key in ("global_segment_size", "local_buffer_size"):
        out[key] = int(out[key])
    return out


class MooncakeStorage:
    name = "mooncake"
    parallel_reads = False  # get_many is one batch: its transfers already run together

    def __init__(self, extra: dict):
        cfg = settings(extra)
        master = cfg["master_server_address"]
        if not master:
            raise ValueError(f"{FLAG} needs master_server_address (host:port of mooncake_master) in "
                             "--hicache-storage-backend-extra-config or $MOONCAKE_MASTER")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ValueError(f"{FLAG} needs the Mooncake client: pip install 'sgrec[mooncake]' "
                             f"(and libibverbs1 from the OS) ({e})") from None
        host, _, port = master.rpartition(":")
        try:  # the client retries an absent master for about 90 s: ask first, briefly
            socket.create_connection((host, int(port)), timeout=3).close()
        except (OSError, ValueError) as e:
            raise ValueError(f"{FLAG}: no Mooncake master answers at {master} ({e})") from None
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(cfg["local_hostname"], cfg["metadata_server"], cfg["global_segment_size"],
                              cfg["local_buffer_size"], cfg["protocol"], "", master)
        if rc != 0:
            raise ValueError(f"{FLAG}: the client could not join the master at {master} (error {rc})")

    def exists(self, key: str) -> bool:
        r = self.store.is_exist(key)
        if r < 0:
            raise OSError(f"mooncake is_exist failed (error {r})")
        return r == 1

    def get(self, key: str) -> bytes | None:
        data = self.store.get(key)
        if data:
            return data
        if not self.exists(key):  # raises when the master is unreachable
            return None
        raise OSError("mooncake get returned nothing for an object the master lists")

    def put(self, key: str, data: bytes) -> None:
        rc = self.store.put(key, data)
        if rc != 0:
            raise OSError(f"mooncake put failed (error {rc})")

    def exists_many(self, keys: list[str]) -> list[bool]:
        """Whether each object is stored: one round trip. Raises when the master does not answer."""
        flags = self.store.batch_is_exist(keys) if keys else []
        if len(flags) != len(keys) or any(f < 0 for f in flags):
            raise OSError("mooncake batch_is_exist failed")
        return [f == 1 for f in flags]

    def get_many(self, keys: list[str]) -> list:
        """Each object's bytes, None when missing, or an OSError for one the master lists but whose
        bytes did not come (its server died): two round trips for the whole batch. Raises when the
        master does not answer."""
        stored = self.exists_many(keys)
        present = [k for k, ok in zip(keys, stored) if ok]
        got = dict(zip(present, self.store.get_batch(present))) if present else {}
        lost = OSError("mooncake get returned nothing for an object the master lists")
        return [(got.get(k) or lost) if ok else None for k, ok in zip(keys, stored)]

    def put_many(self, items: list[tuple[str, bytes]]) -> list:
        """Writes the objects in one batch; per object None, or an OSError when it is not stored
        after a failed batch (an object that another server stored meanwhile, with the same bytes
        since keys name the content, is not a failure). Raises when the master does not answer."""
        keys = [k for k, _ in items]
        rc = self.store.put_batch(keys, [d for _, d in items]) if items else 0
        if rc == 0:
            return [None] * len(items)
        return [None if there else OSError(f"mooncake put_batch failed (error {rc})")
                for there in self.exists_many(keys)]

    def remove(self, key: str) -> None:
        self.store.remove(key)

    def close(self) -> None:
        self.store.close()
