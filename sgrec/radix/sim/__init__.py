"""Evaluation tooling for the prefix cache, not serving code: the trace simulator (`simulator.py`,
`python -m sgrec.radix.sim`) and its request traces (`traces.py`). No module outside this folder
imports it (tests/test_layers.py); benchmarks and tests do."""

from sgrec.radix.sim.simulator import (
    LCS_POLICIES, SGLANG_POLICIES, SGREC_POLICIES, SGLangReplay, SgrecReplay, SimResult, TraceIndex, load, main, replay,
    run_libcachesim, sglang_counter_clock, sim_policy, simulate,
)

__all__ = ["LCS_POLICIES", "SGLANG_POLICIES", "SGREC_POLICIES", "SGLangReplay", "SgrecReplay", "SimResult", "TraceIndex",
           "load", "main", "replay", "run_libcachesim", "sglang_counter_clock", "sim_policy", "simulate"]
