"""Rank on a family with recurrent layers: user-as-prefix, one state fork per candidate.

A recurrent layer reads its tokens in order, so candidates cannot sit side by side behind the user
under a bipartite mask (each would read the ones before it). Instead each candidate continues the
user on its own, as the model would read that one prompt:

    [U] ──► state S_U, KV of U ──fork──► [I_1, Instr]   [I_2, Instr]   ...   [I_n, Instr]

The user's tokens are computed once (or resumed from a cached state snapshot: only the tokens after
it), in the same forward as the candidates: every candidate's attention layers read the user's KV in
place, and each recurrent layer copies the user's state into one state slot per candidate once it has
read the user's tokens (ForwardBatch.state_parents). Candidate j's tokens sit at positions len(U)
onwards.

Scores (`forward_many`): by id token, the softmax over the candidates of each continuation's
last-token logit at its own id token; by semantic ID, each path's log-likelihood after its own
continuation (path tokens teacher-forced after the instruction, full-vocabulary log_softmax, as
`sgrec.rank.semantic` scores them). Candidates never read one another, so a candidate's score does
not depend on the others, their order or their number (the softmax aside).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sgrec.model.attention import SeqLayout


@dataclass
class ForkedForward:
    """One rank request on forked continuations: the user's tokens, the KV of their first
    len(cached) tokens and the state after them (a locked snapshot slot, None: a zero state), each
    candidate's continuation (its item tokens, then the instruction) and what scores it (`targets`:
    id tokens, ints, or semantic-ID paths, tuples). `keep` (when given) receives the user's fresh
    KV slots ("user") and a state slot holding the user's state ("state"), handed to the caller."""

    user: list[int]
    cached: torch.Tensor
    state: torch.Tensor | None
    continuations: list[list[int]]
    targets: list[int] | list[tuple[int, ...]]
    keep: dict[str, torch.Tensor | None] | None = None

    @property
    def by_path(self) -> bool:
        return isinstance(self.targets[0], tuple)

    def rows(self) -> list[list[int]]:
        """Each candidate's forwarded tokens: its continuation, then its path but the last token."""
        if not self.by_path:
            return self.continuations
        return [c + [int(t) for t in p[:-1]] for c, p in zip(self.continuations, self.targets)]


def tokens(user: int, items: list[int], instruction: int, path_tokens: int = 0) -> int:
    """Tokens a forked rank request forwards at most: the user, and per candidate its item tokens,
    the instruction and its path rows (`path_tokens` each)."""
    return user + sum(items) + len(items) * (instruction + path_tokens)


def forward_many(runner, specs: list[ForkedForward], make_room) -> tuple[list[torch.Tensor], float, int]:
    """One forward for every request: the users' uncached tokens (each into a fresh state slot that
    starts from its snapshot or zero) and every candidate of every request, each from its own copy
    of its user's state (taken, layer by layer, once the user's tokens are read:
    ForwardBatch.state_parents). make_room(tokens, states) makes room or raises. Returns per request
    its scores (id tokens: the softmax over candidates; paths: float32 log-likelihoods), the
    forward's seconds and the tokens forwarded. Every slot it takes is freed before it returns,
    except those handed over through `keep`."""
    alloc, states, dev = runner.memory.allocator, runner.memory.states, runner.device
    taken_kv: list[torch.Tensor] = []  # freed at the end (what `keep` took is removed first)
    taken_states: list[torch.Tensor] = []
    try:
        fresh = [len(s.user) - s.cached.numel() for s in specs]
        rows = [s.rows() for s in specs]
        count = sum(len(r) for rs in rows for r in rs)
        forks = sum(len(rs) for rs in rows)
        make_room(sum(fresh) + count, len(specs) + forks)
        user_kv, user_state = [], []
        for s, n in zip(specs, fresh):
            slot = states.take(1)
            taken_states.append(slot)
            if s.state is None:
                states.zero_(slot)
            else:
                states.copy_(slot, s.state)
            new = alloc.alloc(n)
            taken_kv.append(new)
            user_kv.append(torch.cat([s.cached.to(new.device), new]))
            user_state.append(slot)
        own, fork_states = alloc.alloc(count), states.take(forks)
        taken_kv.append(own)
        taken_states.append(fork_states)
        ids, pos, seqs, locs, slots, parents = [], [], [], [], [], []
        parent_of = {}
        for i, (s, n) in enumerate(zip(specs, fresh)):  # the users' fresh tokens: one sequence each
            if n:
                c = s.cached.numel()
                parent_of[i] = len(seqs)
                seqs.append(SeqLayout(len(ids), n, user_kv[i]))
                ids += s.user[c:]
                pos += range(c, len(s.user))
                locs.append(user_kv[i][c:])
                slots.append(user_state[i])
                parents.append(-1)
        read, off, k = [], 0, 0
        for i, (s, rs) in enumerate(zip(specs, rows)):  # then every candidate
            mine = fork_states[k : k + len(rs)]
            if i not in parent_of:  # nothing of the user to read: the copies now
                states.broadcast_(mine, user_state[i])
            u = len(s.user)
            for j, r in enumerate(rs):
                own_j = own[off : off + len(r)]
                seqs.append(SeqLayout(len(ids), len(r), torch.cat([user_kv[i], own_j])))
                last = len(ids) + len(s.continuations[j]) - 1  # the instruction's last token, then the path rows
                read.append(list(range(last, len(ids) + len(r))))
                ids += r
                pos += range(u, u + len(r))
                locs.append(own_j)
                slots.append(mine[j : j + 1])
                parents.append(parent_of.get(i, -1))
                off += len(r)
            k += len(rs)
        batch = runner.make_batch(ids, pos, torch.cat(locs), seqs, slots, parents if parent_of else None)
        t0 = time.perf_counter()
        hidden = runner.hidden(batch, [x for r in read for x in r])
        seconds = time.perf_counter() - t0
        out, a, c = [], 0, 0
        for s, rs in zip(specs, rows):
            n = len(rs)
            mine = read[c : c + n]
            h = hidden[a : a + sum(len(r) for r in mine)]
            if not s.by_path:  # each continuation's last-token logit at its own id token
                cols = torch.tensor(s.targets, device=dev)
                logits = runner.compute_logits(h, cols)
                out.append(torch.softmax(logits.diagonal(), dim=0).cpu())
            else:
                lp = torch.log_softmax(runner.compute_logits(h).float(), -1)
                tok = torch.tensor([t for p in s.targets for t in p], device=lp.device)
                per = lp[torch.arange(lp.shape[0], device=lp.device), tok]
                out.append(torch.stack([x.sum() for x in per.split([len(r) for r in mine])]).cpu())
            a += h.shape[0]
            c += n
        for s, new, st in zip(specs, taken_kv, user_state):
            if s.keep is not None:
                s.keep["user"], s.keep["state"] = new, st
        kept = {id(t) for s in specs if s.keep is not None for t in (s.keep["user"], s.keep["state"])}
        taken_kv = [t for t in taken_kv if id(t) not in kept]
        taken_states = [t for t in taken_states if id(t) not in kept]
        return out, seconds, sum(fresh) + count
    finally:
        if taken_kv:
            alloc.free(torch.cat(taken_kv))
        if taken_states:
            states.free(torch.cat(taken_states))
