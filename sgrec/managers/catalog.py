"""The front's side of catalog updates, one at a time:

1. validate the batch here (tokenizing `text` items), so a malformed one is a 400 naming its first
   bad item before any rank sees it;
2. every rank builds the next version off its step (phase one) and says whether it applies;
3. the journal record is appended and fsynced (the update is durable from here);
4. every rank serves the new version from its next step (phase two); then it is acknowledged.

A batch that fails on any rank in phase one is dropped on every rank and changes nothing. A request
admitted after the acknowledgement runs on the new version on whichever rank it lands.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from sgrec.catalog.codebooks import Codebooks
from sgrec.catalog.item import CatalogError
from sgrec.catalog.journal import Journal
from sgrec.catalog.sid import SidTokens
from sgrec.catalog.update import UpdateError, assign_semantic_ids, canonical_lines, check_ids, parse_items
from sgrec.managers import io_struct as io

logger = logging.getLogger("sgrec.catalog")


class CatalogRequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class CatalogAdmin:
    def __init__(self, socks, tokenizer, vocab_size: int, journal_path: str | None, facts: dict | None,
                 semantic_id_tokens: str | None = None, codebooks_path: str | None = None):
        """ValueError (a start-up error) when --semantic-id-tokens or --semantic-id-codebooks do not
        fit the model's vocabulary or the catalog."""
        self.socks = socks
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.journal = None if journal_path is None else Journal(journal_path)
        self.facts = facts  # the current version's facts (GET /v1/catalog), from the ranks
        self.lock = asyncio.Lock()
        self.waiting: dict[str, tuple[str, dict[int, io.CatalogReply], asyncio.Future]] = {}
        if facts is None and (semantic_id_tokens or codebooks_path):
            raise ValueError("--semantic-id-tokens and --semantic-id-codebooks need an --item-catalog")
        self.sid = None if semantic_id_tokens is None else SidTokens(semantic_id_tokens, tokenizer)
        self.codebooks = None if codebooks_path is None else self._codebooks(codebooks_path)

    def _codebooks(self, path: str) -> Codebooks:
        books = Codebooks.load(path, self.vocab_size)
        nd = None if self.facts is None else self.facts.get("semantic_id_len")
        if nd is not None and nd != books.levels:
            raise CatalogError(f"--semantic-id-codebooks {path!r} has {books.levels} levels, the catalog's semantic "
                               f"IDs {nd} tokens")
        if self.sid is not None:
            if self.sid.levels != books.levels:
                raise CatalogError(f"--semantic-id-codebooks {path!r} has {books.levels} levels, "
                                   f"--semantic-id-tokens {self.sid.levels}")
            self.sid.to_codes(books.token_ids.T)  # its tokens are the template's codes (CatalogError if not)
        return books

    @property
    def version(self) -> int | None:
        return None if self.facts is None else self.facts["version"]

    # ---- routes ---------------------------------------------------------------------------
    def record(self, op: str, body) -> tuple[dict, dict[str, list[int]]]:
        """The journal record of a request body (without its version), and the semantic IDs the
        codebooks assigned (item id -> tokens); CatalogRequestError 400."""
        if self.facts is None:
            raise CatalogRequestError(400, "this server has no item catalog (--item-catalog)")
        if not isinstance(body, dict):
            raise CatalogRequestError(400, "the request body must be a JSON object")
        try:
            if op == "upsert":
                objs, assigned = assign_semantic_ids(body.get("items"), self.codebooks, self.sid)
                items = parse_items(objs, self.tokenizer, self.vocab_size, self.sid)
                return {"op": op, "items": canonical_lines(items)}, assigned
            if op == "delete":
                return {"op": op, "ids": check_ids(body.get("ids"))}, {}
            to = body.get("version")
            if type(to) is not int or not 0 <= to < 2 ** 63:
                raise UpdateError("version must be an integer in [0, 2^63) (a kept catalog version)")
            return {"op": op, "to": to}, {}
        except UpdateError as e:
            raise CatalogRequestError(400, str(e)) from None

    async def update(self, op: str, body) -> dict:
        """Applies one update on every rank; the answer: the new version and the update's counts."""
        if self.facts is not None:  # validating the body is work beside the steps too, accepted or not
            self._send_all(io.CatalogTraffic())
        rec, assigned = self.record(op, body)
        async with self.lock:
            rec = {"version": self.version + 1, **rec}
            uid = uuid.uuid4().hex
            prepared = await self._round(uid, "prepared", io.CatalogUpdateReq(uid, rec))
            failed = [r for r in prepared.values() if r.stage == "failed"]
            if failed:
                self._send_all(io.CatalogCommitReq(uid, commit=False))
                raise CatalogRequestError(failed[0].status_code, failed[0].message)
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.journal.append, rec)
            except (OSError, CatalogError) as e:
                self._send_all(io.CatalogCommitReq(uid, commit=False))
                logger.error("catalog journal append failed: %s", e)
                raise CatalogRequestError(503 if isinstance(e, CatalogError) else 500,
                                          f"the update could not be made durable: {e}") from None
            committed = await self._round(uid, "committed", io.CatalogCommitReq(uid))
            served = [r for r in committed.values() if r.stage == "committed"]
            self.facts = served[0].info if served else {**self.facts, "version": rec["version"]}
            if len(served) < len(committed):  # journaled, so it is the version after a restart
                raise CatalogRequestError(500, next(r.message for r in committed.values() if r.stage == "failed"))
        counts = prepared[0].info or {}
        out = {"version": rec["version"], **counts}
        if op == "rollback":
            out = {"version": rec["version"], "rolled_back_to": rec["to"]}
        if assigned:
            out["assigned"] = assigned
        return out

    # ---- messages -------------------------------------------------------------------------
    def _send_all(self, msg) -> None:
        for s in self.socks:
            s.send(io.encode(msg))

    async def _round(self, uid: str, stage: str, msg) -> dict[int, io.CatalogReply]:
        """Sends msg to every rank and waits for each one's reply of this stage (or a failure)."""
        fut = asyncio.get_running_loop().create_future()
        self.waiting[uid] = (stage, {}, fut)
        try:
            self._send_all(msg)
            return await fut
        finally:
            self.waiting.pop(uid, None)

    def on_reply(self, msg: io.CatalogReply) -> None:
        entry = self.waiting.get(msg.uid)
        if entry is None:
            return
        stage, replies, fut = entry
        if msg.stage in (stage, "failed"):
            replies[msg.dp_rank] = msg
            if len(replies) == len(self.socks) and not fut.done():
                fut.set_result(replies)

    def fail_all(self, message: str) -> None:
        """A scheduler died: no round can finish."""
        for _, _, fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(CatalogRequestError(500, message))
