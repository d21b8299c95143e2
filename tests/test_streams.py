"""Multi-stream executor (RecOS §2-§3): DepValue, stream selection, Figure 3 on the simulator,
the per-stream tensor pool; inline and CUDA backends."""

import random

import pytest
import torch

from sgrec.policy.streams import (
    CudaStreams, DoneEvent, InlineStreams, MultiStreamScheduler, SimStreams, StreamTensorPool, UnitCost,
    WorkloadMonitor, WorkUnit, dep_values, make_backend, select_stream,
)

# RecOS Figure 3's graph as far as the text pins it down: six identical ops, each using under a
# quarter of the device; a query takes 6 time units on one stream, 5 on two streams in
# topological order, 4 on three streams, and 4 on two streams when the critical op v3 goes first
# (its dependents v4 and v6 can then start earlier). v1 is the source.
EDGES = [(1, 2), (1, 5), (1, 3), (3, 4), (3, 6), (4, 6)]
TOPO_ORDER = [1, 2, 5, 3, 4, 6]  # a topological order that lists v3 after its siblings


def query(q: int, occupancy: float = 0.25) -> list[WorkUnit]:
    return [WorkUnit(f"q{q}.v{v}", UnitCost(1.0, occupancy), tuple(f"q{q}.v{a}" for a, b in EDGES if b == v),
                     group=f"q{q}") for v in TOPO_ORDER]


def run_queries(num_queries: int, num_streams: int, policy: str):
    sim = SimStreams(num_streams)
    sch = MultiStreamScheduler(sim, policy)
    for q in range(num_queries):
        sch.submit(query(q))
    sch.run_until_idle()
    latency = [max(sch.completed[f"q{q}.v{v}"] for v in TOPO_ORDER) for q in range(num_queries)]
    return sim, sch, latency


def max_occupancy(trace) -> float:
    times = sorted({t for _, _, s, e in trace for t in (s, e)})
    return max(sum(0.25 for _, _, s, e in trace if s <= t < e) for t in times)


def test_dep_value():
    dv = dep_values(query(0))
    # v6 = 1; v4 = 1 + v6/2; v3 = 1 + v4/1 + v6/2; v1 = 1 + v2 + v3 + v5 (each of indegree 1)
    assert dv == {"q0.v6": 1.0, "q0.v4": 1.5, "q0.v3": 3.0, "q0.v2": 1.0, "q0.v5": 1.0, "q0.v1": 6.0}
    with pytest.raises(ValueError, match="cycle"):
        dep_values([WorkUnit("a", UnitCost(1, 1), ("b",)), WorkUnit("b", UnitCost(1, 1), ("a",))])
    with pytest.raises(ValueError, match="unknown"):
        dep_values([WorkUnit("a", UnitCost(1, 1), ("zz",))])


def test_one_query_depvalue_picks_the_critical_op_first():
    assert run_queries(1, 1, "single")[0].now() == 6.0
    assert run_queries(1, 3, "topo")[0].now() == 4.0
    sim, sch, _ = run_queries(1, 2, "topo")
    assert sim.now() == 5.0 and [n for n, _ in sch.launch_order[1:3]] == ["q0.v2", "q0.v5"]
    sim, sch, _ = run_queries(1, 2, "depvalue")
    assert sim.now() == 4.0 and sch.launch_order[1][0] == "q0.v3"  # after v1: v3, the highest DepValue


def test_figure3_five_queries_throughput_ordering():
    single, _, lat_single = run_queries(5, 1, "single")
    per_query, sch_pq, lat_pq = run_queries(5, 4, "per_query")
    ours, _, lat_ours = run_queries(5, 4, "depvalue")
    thr = {name: 5 / sim.now() for name, sim in (("single", single), ("per_query", per_query), ("depvalue", ours))}
    assert single.now() == 30.0 and round(thr["single"], 3) == 0.167  # one op at a time
    assert per_query.now() == 12.0 and round(thr["per_query"], 3) == 0.417  # query 5 queues behind query 1
    assert {s for n, s in sch_pq.launch_order if n.startswith("q4.")} == {0}  # round-robin: back on stream 0
    assert ours.now() == 8.0 and thr["depvalue"] == 0.625  # 30 ops on 4 quarter-device slots: ceil(7.5)
    assert thr["single"] < thr["per_query"] < thr["depvalue"]
    assert sum(lat_ours) / 5 < sum(lat_pq) / 5 < sum(lat_single) / 5
    assert max_occupancy(ours.trace) == 1.0  # never more than the device


def test_select_stream_rules():
    m = WorkloadMonitor(3)
    never = DoneEvent()
    never.done = lambda: False
    u = lambda t, occ: WorkUnit(f"u{t}{occ}", UnitCost(t, occ))  # noqa: E731
    m.launched(0, u(2.0, 0.5), never)
    assert select_stream(m, u(1, 0.5)) == 1  # idle streams first, lowest index
    m.launched(1, u(1.0, 0.5), never)
    m.launched(2, u(3.0, 0.5), never)
    assert [m.completion_time(s) for s in range(3)] == [2.0, 1.0, 3.0]
    # stream 1 drains first (t=1); then streams 0 and 2 still run 0.5 + 0.5 = 1.0
    assert m.occupancy_at(1.0, exclude=1) == 1.0
    assert select_stream(m, u(1, 0.25)) == 0  # 1.0 + 0.25 > 1: the second shortest
    assert select_stream(m, u(1, 0.25), occupancy_threshold=1.25) == 1
    m2 = WorkloadMonitor(2)
    m2.launched(0, u(1.0, 0.25), never)
    m2.launched(1, u(2.0, 0.5), never)
    assert select_stream(m2, u(1, 0.5)) == 0  # at t=1 only 0.5 runs elsewhere: fits


def test_monitor_drops_completed_units_in_stream_order():
    sim = SimStreams(2)
    m = WorkloadMonitor(2)
    a, b, c = (WorkUnit(n, UnitCost(t, 0.5)) for n, t in (("a", 1.0), ("b", 2.0), ("c", 1.5)))
    for s, unit in ((0, a), (0, b), (1, c)):
        m.launched(s, unit, sim.launch(unit, s))
    assert m.completion_time(0) == 3.0 and m.completion_time(1) == 1.5
    sim.advance()
    assert [u.name for _, u, _ in m.poll()] == ["a"] and sim.now() == 1.0
    sim.advance()
    assert [u.name for _, u, _ in m.poll()] == ["c"] and m.completion_time(0) == 2.0 and m.is_idle(1)
    sim.synchronize()
    assert [u.name for _, u, _ in m.poll()] == ["b"] and sim.now() == 3.0


def test_simulator_waits_for_room_on_the_device():
    sim = SimStreams(3)
    for s, occ in enumerate((0.5, 0.5, 0.5)):
        sim.launch(WorkUnit(f"u{s}", UnitCost(1.0, occ)), s)
    sim.synchronize()
    assert [(n, st, e) for n, _, st, e in sim.trace] == [("u0", 0.0, 1.0), ("u1", 0.0, 1.0), ("u2", 1.0, 2.0)]
    sim2 = SimStreams(2)
    first = sim2.launch(WorkUnit("a", UnitCost(2.0, 0.25)), 0)
    sim2.launch(WorkUnit("b", UnitCost(1.0, 0.25)), 1, wait_for=[first])  # a cross-stream dependency
    sim2.synchronize()
    assert sim2.trace[1] == ("b", 1, 2.0, 3.0)


def test_tensor_pool_releases_only_after_the_event():
    sim = SimStreams(2)
    released = []

    def release(t):
        assert events[id(t)].done(), "released while a kernel may still read it"
        released.append(t)

    pool = StreamTensorPool(2, threshold_bytes=100, release=release)
    events = {}
    w = torch.zeros(4)
    events[id(w)] = DoneEvent()
    pool.add(1, w, events[id(w)])  # done, but stream 1's pool (16 bytes) is under the threshold: kept
    assert released == [] and pool.pending_bytes(1) == 16
    x = torch.zeros(15)  # 60 bytes
    ev = sim.launch(WorkUnit("k0", UnitCost(1.0, 0.5)), 0)
    events[id(x)] = ev
    pool.add(0, x, ev)
    assert pool.pending_bytes(0) == 60 and released == []  # under the threshold: not checked
    y = torch.zeros(15)
    events[id(y)] = ev
    pool.add(0, y, ev)  # 120 > 100: checked, but k0 is still running
    assert released == [] and pool.pending_bytes(0) == 120
    sim.advance()
    assert ev.done() and sim.now() == 1.0
    z = torch.zeros(1)
    events[id(z)] = sim.launch(WorkUnit("k1", UnitCost(1.0, 0.5)), 0)
    pool.add(0, z, events[id(z)])  # 124 > 100: x and y go, z (k1 running) stays
    assert released == [x, y] and pool.pending_bytes(0) == 4 and pool.released_bytes == 120
    assert pool.collect() == 16 and released[-1] is w and len(pool) == 1  # an explicit check takes w
    sim.synchronize()
    assert pool.collect() == 4 and released[-1] is z and len(pool) == 0
    with pytest.raises(TypeError):
        pool.add(1, object(), ev)


def test_tensor_pool_random_events_never_release_early():
    rng = random.Random(7)
    for trial in range(20):
        sim = SimStreams(3, capacity=1.0)
        owner = {}

        def release(t):
            assert owner[id(t)].done()

        pool = StreamTensorPool(3, threshold_bytes=rng.choice([0, 64, 256]), release=release)
        tensors = []
        for k in range(40):
            s = rng.randrange(3)
            ev = sim.launch(WorkUnit(f"k{trial}.{k}", UnitCost(rng.uniform(0.1, 2.0), rng.choice([0.25, 0.5]))), s)
            t = torch.zeros(rng.randint(1, 30))
            tensors.append(t)
            owner[id(t)] = ev
            pool.add(s, t, ev)
            if rng.random() < 0.3:
                sim.advance()
        sim.synchronize()
        pool.collect()
        assert len(pool) == 0 and pool.released_bytes == sum(t.numel() * 4 for t in tensors)


def test_inline_backend_runs_a_dag_in_dependency_order():
    ran = []
    units = [WorkUnit(u.name, u.cost, u.deps, u.group, fn=(lambda n=u.name: ran.append(n) or n)) for u in query(0)]
    sch = MultiStreamScheduler(InlineStreams(clock=lambda: 0.0), "depvalue")
    sch.submit(units)
    sch.run_until_idle()
    assert ran == ["q0.v1", "q0.v3", "q0.v4", "q0.v2", "q0.v5", "q0.v6"]  # DepValue order, one stream
    assert sch.events["q0.v4"].result == "q0.v4" and sch.idle
    with pytest.raises(ValueError, match="one stream"):
        InlineStreams().launch(units[0], 1)
    assert isinstance(make_backend("inline"), InlineStreams) and isinstance(make_backend("sim", 3), SimStreams)
    with pytest.raises(ValueError):
        make_backend("gpu")


def test_scheduler_rejects_bad_input():
    sch = MultiStreamScheduler(SimStreams(2))
    sch.submit(query(0))
    with pytest.raises(ValueError, match="already submitted"):
        sch.submit(query(0))
    with pytest.raises(ValueError, match="policy"):
        MultiStreamScheduler(SimStreams(1), "fifo")
    with pytest.raises(ValueError):
        UnitCost(1.0, 0.0)
    late = WorkUnit("late", UnitCost(1.0, 0.5), deps=("q0.v6",))  # depends on an earlier DAG
    sch.submit([late])
    sch.run_until_idle()
    assert sch.completed["late"] == sch.completed["q0.v6"] + 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_backend_refuses_without_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        CudaStreams(2)
    assert isinstance(make_backend("auto"), InlineStreams)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams need a CUDA device (none here)")
def test_cuda_streams_match_serial_results_and_pool_waits():
    torch.manual_seed(0)
    a = torch.randn(512, 512, device="cuda")
    backend = CudaStreams(3)
    out = {}

    def mm(name, *srcs):
        def fn():  # each unit first spins ~5 ms on the device, so that a sibling launched after it finds
            # its stream still busy and takes another, on any GPU however fast (a lone 512^3 product ends
            # before the host launches the next unit, and every unit would then go to stream 0)
            torch.cuda._sleep(10_000_000)
            x = sum(out[s] for s in srcs) if srcs else a
            out[name] = x @ a
            return out[name]
        return fn

    units = [WorkUnit(f"v{v}", UnitCost(1e-4, 0.25), tuple(f"v{p}" for p, c in EDGES if c == v),
                      fn=mm(f"v{v}", *[f"v{p}" for p, c in EDGES if c == v])) for v in TOPO_ORDER]
    sch = MultiStreamScheduler(backend, "depvalue")
    sch.submit(units)
    sch.run_until_idle()
    backend.synchronize()
    ref = {}
    for v in TOPO_ORDER:
        srcs = [f"v{p}" for p, c in EDGES if c == v]
        ref[f"v{v}"] = (sum(ref[s] for s in srcs) if srcs else a) @ a
    for k in ref:
        torch.testing.assert_close(out[k], ref[k])
    assert len({s for _, s in sch.launch_order}) > 1
    released = []

    def release(t):
        assert ev.done(), "released while the kernel may still read it"
        released.append(t)

    pool = StreamTensorPool(3, threshold_bytes=0, release=release)
    ev = backend.launch(WorkUnit("big", UnitCost(1e-3, 1.0), fn=lambda: a @ a @ a @ a), 0)
    pool.add(0, a, ev)  # checked at once (threshold 0): released only if the kernel has finished
    backend.synchronize()
    pool.collect()
    assert ev.done() and released == [a] and len(pool) == 0


def test_pool_threshold_from_server_args():
    from sgrec.policy.streams import DEFAULT_POOL_BYTES, tensor_pool_from_args
    from sgrec.server_args import ServerArgs

    assert tensor_pool_from_args(ServerArgs(), 4).threshold_bytes == DEFAULT_POOL_BYTES == 64 << 20
    assert tensor_pool_from_args(ServerArgs(stream_pool_mb=0.5), 2).threshold_bytes == 1 << 19
    assert ServerArgs().num_streams == 4
    with pytest.raises(ValueError, match="num_streams"):
        ServerArgs(num_streams=0)
