"""Batch formation (xGR §7): token budget, SLO-bounded wait, fixed-step retrieval rounds."""

import pytest
from hypothesis import given, settings, strategies as st

from sgrec.policy.batching import (
    DEFAULT_WAIT_S, BatchFormer, FixedWaitQuota, SloWaitQuota, make_wait_quota, round_phases, run_to_end,
    round_time, run_fixed_round,
)

KINDS = ("rank", "score", "retrieve")


def test_full_batch_goes_at_once_and_the_rest_waits_its_quota():
    bf = BatchFormer(max_batch_tokens=10, wait_quota=0.005)
    bf.add("a", "rank", 4, now=0.000)
    bf.add("b", "rank", 4, now=0.001)
    assert bf.poll(0.002) == []  # 8 of 10 tokens and nothing else queued: not full, quota not reached
    bf.add("c", "rank", 4, now=0.003)  # a + b + c = 12 > 10: a and b form a full batch
    (b1,) = bf.poll(0.003)
    assert [it.rid for it in b1.items] == ["a", "b"] and b1.reason == "full" and b1.num_tokens == 8
    assert bf.poll(0.0079) == [] and bf.deadline("rank") == pytest.approx(0.008)
    (b2,) = bf.poll(0.008)
    assert [it.rid for it in b2.items] == ["c"] and b2.reason == "quota" and b2.dispatched_at == 0.008
    assert len(bf) == 0 and bf.queued_tokens("rank") == 0 and bf.next_deadline() is None


def test_exactly_full_budget_dispatches_and_kinds_batch_separately():
    bf = BatchFormer(max_batch_tokens=10, wait_quota=1.0)
    bf.add("r1", "rank", 6, 0.0)
    bf.add("s1", "score", 4, 0.0)
    bf.add("r2", "rank", 4, 0.1)
    (b,) = bf.poll(0.1)  # rank holds exactly 10 tokens; score's 4 wait
    assert b.kind == "rank" and [it.rid for it in b.items] == ["r1", "r2"] and b.reason == "full"
    assert bf.queued_tokens("score") == 4 and bf.next_deadline() == 1.0
    (f,) = bf.flush(0.2)
    assert f.kind == "score" and f.reason == "flush" and len(bf) == 0


def test_bad_requests_are_refused():
    bf = BatchFormer(max_batch_tokens=8, wait_quota=0.01)
    with pytest.raises(ValueError, match="more than the batch budget"):
        bf.add("big", "rank", 9, 0.0)
    with pytest.raises(ValueError, match="at least one token"):
        bf.add("empty", "rank", 0, 0.0)
    bf.add("a", "rank", 1, 1.0)
    with pytest.raises(ValueError, match="back in time"):
        bf.add("b", "rank", 1, 0.5)
    with pytest.raises(ValueError):
        BatchFormer(max_batch_tokens=0, wait_quota=0.01)


def test_wait_quota_from_slo():
    q = SloWaitQuota(slo_s=0.100)
    bf = BatchFormer(100, q)
    assert bf.quota("rank") == pytest.approx(0.025)  # T_exec starts at slo / 4: (0.1 - 0.05) / 2
    bf.observe("rank", 0.030)
    assert bf.quota("rank") == pytest.approx(0.020)  # (0.1 - 0.06) / 2
    bf.observe("rank", 0.010)  # EMA: 0.8 * 0.030 + 0.2 * 0.010 = 0.026
    assert bf.exec_s["rank"] == pytest.approx(0.026) and bf.quota("rank") == pytest.approx(0.024)
    assert bf.quota("score") == pytest.approx(0.025)  # per kind
    bf.observe("retrieve", 0.070)
    assert bf.quota("retrieve") == 0.0  # no slack left: dispatch at once
    assert BatchFormer(100, 0.003).quota("rank") == 0.003  # a fixed wait ignores the batch times
    assert make_wait_quota(3.0, 100.0) == FixedWaitQuota(0.003)  # an explicit wait wins
    assert isinstance(make_wait_quota(None, 100.0), SloWaitQuota)
    assert make_wait_quota(None, None) == FixedWaitQuota(DEFAULT_WAIT_S)
    with pytest.raises(ValueError):
        SloWaitQuota(0.0)


def test_slo_quota_drives_dispatch():
    q = SloWaitQuota(slo_s=0.040)
    bf = BatchFormer(100, q)
    bf.add("a", "score", 5, 0.0)
    assert bf.poll(0.0099) == [] and len(bf.poll(0.010)) == 1  # quota 10 ms
    bf.observe("score", 0.016)  # quota (0.04 - 0.032) / 2 = 4 ms
    bf.add("b", "score", 5, 1.0)
    assert bf.poll(1.0039) == [] and len(bf.poll(1.004)) == 1


arrivals = st.lists(
    st.tuples(st.floats(0, 0.05, allow_nan=False), st.sampled_from(KINDS), st.integers(1, 40)),
    min_size=1, max_size=60)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(arrivals=arrivals, cap=st.integers(40, 120), quota=st.floats(0, 0.02), tick=st.floats(0.0005, 0.004))
def test_budget_quota_and_no_starvation(arrivals, cap, quota, tick):
    arrivals = sorted(arrivals, key=lambda a: a[0])
    bf = BatchFormer(cap, quota)
    reqs = {f"r{i}": a for i, a in enumerate(arrivals)}
    order = {k: [r for r, a in reqs.items() if a[1] == k] for k in KINDS}
    batches, i, k = [], 0, 0
    end = arrivals[-1][0] + quota + 2 * tick
    while True:  # the scheduler polls once per tick; requests are added when they arrive
        now = k * tick
        while i < len(arrivals) and arrivals[i][0] <= now:
            t, kind, n = arrivals[i]
            bf.add(f"r{i}", kind, n, t)
            i += 1
        batches += bf.poll(now)
        assert all(bf.queued_tokens(kd) < cap for kd in KINDS)  # a full batch never waits for a later tick
        if now > end:
            break
        k += 1
    seen = [it.rid for b in batches for it in b.items]
    assert sorted(seen) == sorted(reqs) and len(bf) == 0  # each dispatched exactly once, none starves
    next_in_kind = {k: 0 for k in KINDS}
    for b in batches:
        assert 0 < b.num_tokens <= cap
        assert all(it.kind == b.kind for it in b.items)
        ids = [it.rid for it in b.items]
        pos = next_in_kind[b.kind]
        assert ids == order[b.kind][pos:pos + len(ids)]  # FIFO within a kind
        next_in_kind[b.kind] += len(ids)
        for it in b.items:
            assert b.dispatched_at - it.arrival <= quota + tick + 1e-12  # quota exceeded by < one tick
        if b.reason == "quota":
            assert b.dispatched_at >= b.items[0].arrival + quota
        else:
            assert b.reason == "full"
            nxt = order[b.kind][next_in_kind[b.kind]:next_in_kind[b.kind] + 1]
            assert b.num_tokens == cap or (nxt and b.num_tokens + reqs[nxt[0]][2] > cap)


class Recorder:
    """Hooks on a virtual clock: host work advances the host clock; device work runs from launch
    on a single device queue; finish waits for it."""

    def __init__(self, host_s, device_s):
        self.host_s, self.device_s = host_s, device_s
        self.host = 0.0
        self.device_free = 0.0
        self.calls = []

    def prepare(self, step, phase):
        self.calls.append(("prepare", step, phase))
        self.host += self.host_s[step]
        return ("buffers", step)

    def launch(self, step, phase, prepared):
        assert prepared == ("buffers", step)
        self.calls.append(("launch", step, phase))
        self.device_free = max(self.host, self.device_free) + self.device_s[step]
        return self.device_free

    def finish(self, step, phase, handle):
        self.calls.append(("finish", step, phase))
        self.host = max(self.host, handle)


def test_fixed_round_overlaps_next_preparation_with_device_work():
    assert round_phases(3) == ["prefill", "beam", "beam", "beam"]
    host, dev = [1.0, 2.0, 0.5, 3.0], [4.0, 1.0, 2.0, 1.0]
    r = Recorder(host, dev)
    run_fixed_round(r, num_levels=3)
    assert [(c, s) for c, s, _ in r.calls] == [
        ("prepare", 0), ("launch", 0), ("prepare", 1), ("finish", 0), ("launch", 1), ("prepare", 2),
        ("finish", 1), ("launch", 2), ("prepare", 3), ("finish", 2), ("launch", 3), ("finish", 3)]
    assert r.calls[0][2] == "prefill" and {p for _, s, p in r.calls if s > 0} == {"beam"}
    # 1 + max(4, 2) + max(1, 0.5) + max(2, 3) + 1 = 10
    assert r.host == round_time(host, dev, overlap=True) == 10.0
    serial = Recorder(host, dev)
    run_fixed_round(serial, num_levels=3, overlap=False)
    assert [c for c, _, _ in serial.calls] == ["prepare", "launch", "finish"] * 4
    assert serial.host == round_time(host, dev, overlap=False) == 14.5


def test_round_phases_and_run_to_end():
    assert round_phases(2) == ["prefill", "beam", "beam"]
    assert round_phases(0) == ["prefill"]  # one semantic-ID level: selected from the prefill's logits
    with pytest.raises(ValueError):
        round_phases(-1)
    closed = []

    def phases(waits: bool):
        try:
            for i in range(3):
                yield -1 if waits and i == 1 else i
            return "results"
        finally:
            closed.append(waits)

    assert run_to_end(phases(False)) == "results" and closed == [False]
    with pytest.raises(RuntimeError, match="drive them in turn"):  # nobody else would end the wait
        run_to_end(phases(True))
    assert closed == [False, True]  # the waiting generator was closed (what it held released)


def test_from_server_args():
    from sgrec.policy.batching import batch_former_from_args
    from sgrec.server_args import ServerArgs

    bf = batch_former_from_args(ServerArgs(max_batch_tokens=32, slo_ms=40.0))
    assert bf.max_batch_tokens == 32 and bf.quota("rank") == pytest.approx(0.010)
    assert batch_former_from_args(ServerArgs(batch_wait_ms=3.0).sized_for("cpu")).wait_quota == FixedWaitQuota(0.003)
    with pytest.raises(ValueError, match="below slo_ms"):
        ServerArgs(batch_wait_ms=50.0, slo_ms=40.0)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        ServerArgs(max_batch_tokens=0)


def test_sizes_follow_the_device_unless_given():
    """chunked_prefill_size and max_batch_tokens: 2048 and 16384 on CPU; on CUDA by the GPU's memory
    (SGLang's tiers for the chunk), the batch at least four chunks; a value given is kept."""
    from sgrec.server_args import ServerArgs

    gib = 2**30
    sizes = lambda a: (a.chunked_prefill_size, a.max_batch_tokens)  # noqa: E731
    assert sizes(ServerArgs().sized_for("cpu")) == (2048, 16384)
    assert sizes(ServerArgs().sized_for("cpu", 200 * gib)) == (2048, 16384)  # memory counts on CUDA only
    assert sizes(ServerArgs().sized_for("cuda", 24 * gib)) == (2048, 16384)  # an RTX 4090
    assert sizes(ServerArgs().sized_for("cuda", 80 * gib)) == (8192, 32768)  # an H100
    assert sizes(ServerArgs().sized_for("cuda", 140 * gib)) == (8192, 32768)  # an H200 (143771 MiB)
    assert sizes(ServerArgs().sized_for("cuda", 180 * gib)) == (16384, 65536)  # a B200
    given = ServerArgs(chunked_prefill_size=512, max_batch_tokens=1000)
    assert given.sized_for("cuda", 80 * gib) is given
    assert sizes(ServerArgs(chunked_prefill_size=-1).sized_for("cuda", 80 * gib)) == (-1, 16384)
    assert sizes(ServerArgs(max_batch_tokens=99).sized_for("cuda", 80 * gib)) == (8192, 99)
    once = ServerArgs().sized_for("cuda", 80 * gib)
    assert once.sized_for("cuda", 80 * gib) is once
