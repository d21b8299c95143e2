"""ServerArgs: every knob of the engine and server, with SGLang's names where the meaning matches."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

DEFAULT_BATCH_TOKENS = 16384  # --max-batch-tokens on CPU, and its least on CUDA
HICACHE_EXTRA_KEYS = frozenset({  # --hicache-storage-backend-extra-config (SGLang's names)
    "file_storage_path", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",  # any backend / file
    "item_reads",  # sgrec's own: BAT's item KV read from storage by cost (default) or always
    "master_server_address", "metadata_server", "global_segment_size", "local_buffer_size", "protocol",  # mooncake
    "local_hostname"})
DEVICE_SIZED = ("chunked_prefill_size", "max_batch_tokens")  # left to ServerArgs.sized_for by default
_ITEMS_ACROSS_SERVERS = ("item KV across servers goes through the storage tier: --enable-hierarchical-cache "
                         "--hicache-storage-backend mooncake (README, 'Scale-out'); the DP ranks of one server "
                         "share their items without a flag")
RETIRED = {  # flags of earlier versions: an error that says what replaced them, not argparse's "unrecognized"
    "--item-peers": _ITEMS_ACROSS_SERVERS, "--item-kv-port": _ITEMS_ACROSS_SERVERS,
    "--item-kv-host": _ITEMS_ACROSS_SERVERS}


def _arg(default, help: str, choices=None, *, at_least=None, at_most=None, above=None, below=None, **kw):
    """A flag: its default, --help text, choices, and the range a value must fall in (checked in
    __post_init__; None, where a flag may be unset, is never out of range)."""
    bounds = {"at_least": at_least, "at_most": at_most, "above": above, "below": below}
    return field(default=default, metadata={"help": help, "choices": choices,
                                            "bounds": {k: v for k, v in bounds.items() if v is not None}, **kw})


def _out_of_range(name: str, value, bounds: dict) -> str | None:
    """The error for a value outside a flag's declared bounds, else None."""
    lo, hi, gt, lt = (bounds.get(k) for k in ("at_least", "at_most", "above", "below"))
    if value is None or not ((lo is not None and value < lo) or (hi is not None and value > hi)
                             or (gt is not None and value <= gt) or (lt is not None and value >= lt)):
        return None
    if gt is not None and lt is not None:
        return f"{name} must be in ({gt}, {lt})"
    if lo is not None and hi is not None:
        return f"{name} must be in [{lo}, {hi}]"
    if gt == 0:
        return f"{name} must be positive"
    return f"{name} must be non-negative" if lo == 0 else f"{name} must be at least {lo}"


@dataclass
class ServerArgs:
    model_path: str | None = _arg(
        None, "HF-format model directory, or `demo` / `demo-tiger` (the packaged MovieLens demos, the decoder-only "
              "and the TIGER-style T5 one, each served with its item catalog). Without it the embedded default "
              "model is served.")
    tokenizer_path: str | None = _arg(None, "Tokenizer directory (default: the model path).")
    served_model_name: str | None = _arg(None, "Model name reported by the API (default: the model path).")
    host: str = _arg("127.0.0.1", "Address to listen on.")
    port: int = _arg(30000, "HTTP port.", at_least=0, at_most=65535)
    device: str = _arg("auto", "Device to run on: auto picks cuda when available.", ["auto", "cpu", "cuda"])
    dtype: str = _arg(
        "auto", "Weights, activations and KV dtype. auto: on CPU bfloat16 where the CPU multiplies it "
        "natively (avx512_bf16 or amx_bf16 in its flags), else float32 (the choice and the flags are logged "
        "at start-up); on CUDA the checkpoint's dtype (bfloat16 for float32 checkpoints). bfloat16 or "
        "float16 on a CPU without native matmuls for it logs a warning: such matmuls run far slower than "
        "float32 (docs/performance.md).", ["auto", "float32", "bfloat16", "float16"])
    context_length: int | None = _arg(None, "Longest prompt + output (default: the model's max_position_embeddings).")
    max_total_tokens: int | None = _arg(None, "KV pool size in tokens (default: from --mem-fraction-static).", at_least=2)
    mem_fraction_static: float | None = _arg(
        None, "Share of free memory for the KV pool (default 0.1 on CPU, capped at 131072 tokens; 0.85 on CUDA).",
        above=0, below=1)
    chunked_prefill_size: int | None = _arg(
        None, "Most prompt tokens in one prefill batch (longer prompts are split across steps); -1 disables "
        "chunking. Default: 2048 on CPU; on CUDA by the GPU's memory, as SGLang picks it: 2048 under 35 GB, "
        "8192 under 160 GB (A100, H100, H200), else 16384.")
    max_prefill_tokens: int = _arg(16384, "Most tokens in one prefill batch.")
    max_running_requests: int = _arg(256, "Most requests decoding at once (per data-parallel rank).", at_least=1)
    max_mamba_cache_size: int | None = _arg(
        None, "State slots of a model with recurrent layers (Qwen3.5's Gated DeltaNet): each running request "
        "holds one, the radix cache's state snapshots the others; a request waits for a free one. Default: "
        "twice --max-running-requests (once with --disable-radix-cache), at most half of the memory share the "
        "KV pool is sized from.", at_least=1)
    max_queued_requests: int | None = _arg(
        None, "Most requests waiting per rank (beyond the free running places); past it new requests get "
        "503 'The request queue is full.', at once and untokenized once running + queued are outstanding", at_least=0)
    schedule_policy: str = _arg(
        "fcfs", "Order of admission: fcfs; lpm (longest cached prefix first); for prefill-only requests "
        "(score, rank, max_new_tokens 0) srjf (shortest remaining job first with the cached prefix re-read "
        "from the radix tree every step, PrefillOnly's continuous JCT calibration) or srjf-static (the cached "
        "prefix read once, on arrival).", ["fcfs", "lpm", "srjf", "srjf-static"])
    jct_fairness: float = _arg(
        500.0, "lambda of SRJF: a request's score is jct - lambda * seconds queued (jct in uncached tokens "
        "by default), so a long request gets through after a bounded wait; 500 as in PrefillOnly; 0: pure SRJF.", at_least=0)
    jct_model: str = _arg(
        "tokens", "Estimated job time of a prefill-only request: tokens (uncached tokens) or linear "
        "(a linear model fitted on profiled prefills at start-up).", ["tokens", "linear"])
    prefill_only_batch_tokens: int = _arg(
        0, "Pack prefill-only requests into one batch up to this many tokens (0: one request at a time).", at_least=0)
    hybrid_chunk_size: int = _arg(
        512, "Hybrid prefilling of prefill-only requests: attention runs over the whole sequence, the MLP "
        "and projections chunk by chunk of this many tokens.", at_least=1)
    max_input_len: int | None = _arg(
        None, "Longest accepted prompt in tokens (longer ones get a 400); the KV pool is sized after a "
        "profile run at this length (default: the context length).", at_least=1)
    radix_eviction_policy: str = _arg(
        "lru", "Eviction policy of the radix prefix cache: lru; laru (learning-augmented LRU, LCR); "
        "fpb (follow the predictor blindly); hf (predictor over the 4 least recent leaves).",
        ["lru", "laru", "fpb", "hf"])
    radix_eviction_policy_config: str | None = _arg(
        None, "JSON object configuring the eviction policy, e.g. "
        '\'{"b": 2, "lambda_rule": "paper", "mode": "sync", "retrain_interval": 1000, "window": 10000}\'; '
        "also lambda_reset (phase, or the opt-in carry/bets), train_async, k_div, num_trees ... (README).")
    enable_hierarchical_cache: bool = _arg(
        False, "SGLang's flag: KV that the radix tree evicts goes down to a host tier (and the storage tier "
        "below it) instead of vanishing, and a prefix found there is loaded back, bit for bit, instead of "
        "recomputed (generate, score, rank's user prefix, retrieve's prompt).")
    hicache_ratio: float | None = _arg(
        None, "Host tier size as a multiple of the KV pool (default 2.0 as SGLang's). On CPU the host tier is "
        "a second store of pages in the same memory.", above=0)
    hicache_size: int = _arg(0, "Host tier size in GB; overrides --hicache-ratio when positive.", at_least=0)
    hicache_write_policy: str = _arg(
        "write_through", "When KV is written down a tier early: write_through (when the tree takes it), "
        "write_through_selective (at a prefix's second hit), write_back (only when evicted). Evicted KV goes "
        "down whatever the policy.", ["write_back", "write_through", "write_through_selective"])
    hicache_page_size: int = _arg(
        16, "sgrec's own: tokens per page of the lower tiers (a page is the unit written, keyed and loaded; "
        "the tail of a prefix shorter than a page is recomputed). Small, as recommendation prefixes are a few "
        "hundred tokens; larger pages mean fewer, larger storage objects.", at_least=1)
    hicache_storage_backend: str | None = _arg(
        None, "SGLang's flag: the storage tier below the host tier, shared by the servers that point at the "
        "same place: file (a directory: $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else the extra config's "
        "file_storage_path, else /tmp/hicache); mooncake (Mooncake Store: a mooncake_master named by the extra "
        "config's master_server_address or $MOONCAKE_MASTER; needs pip install 'sgrec[mooncake]').",
        [None, "file", "mooncake"])
    hicache_storage_prefetch_policy: str = _arg(
        "timeout", "SGLang's flag: how long a request waits in the queue (never the step) for its pages to come "
        "up from storage: best_effort (not at all), wait_complete (until read), timeout (at most "
        "prefetch_timeout_base + prefetch_timeout_per_ki_token * tokens / 1024 seconds; 1 and 0.25 by default).",
        ["best_effort", "wait_complete", "timeout"])
    hicache_storage_backend_extra_config: str | None = _arg(
        None, "SGLang's flag: JSON object of the storage tier's settings: file_storage_path, "
        "prefetch_timeout_base, prefetch_timeout_per_ki_token, item_reads (sgrec's own: cost, the default, reads "
        "rank candidates' item KV only where that is measured to beat recomputing it; always); for mooncake "
        "master_server_address, metadata_server "
        "(P2PHANDSHAKE), global_segment_size (bytes this server adds to the store, 4 GiB), local_buffer_size "
        "(64 MiB), protocol (tcp), local_hostname (127.0.0.1).")
    item_catalog: str | None = _arg(
        None, "Item catalog for /v1/rank and /v1/retrieve: JSON Lines (id, text or token_ids, optional "
        "id_token, semantic_id, attrs), Parquet with those columns (pyarrow), or the binary .npz bundle of "
        "`python -m sgrec.catalog convert`.")
    catalog_journal: str | None = _arg(
        None, "Journal of catalog updates (POST /v1/catalog/...): each update is appended and fsynced here "
        "before it is acknowledged, and replayed over --item-catalog at start-up (default: <catalog>.journal; "
        "for a catalog inside the installed sgrec package, such as the embedded demo's, "
        "$XDG_STATE_HOME/sgrec/<its path in the package>.journal, by default under ~/.local/state: the "
        "install is never written; created on the first update). `python -m sgrec.catalog compact` folds "
        "it into the catalog file.")
    semantic_id_tokens: str | None = _arg(
        None, "Semantic IDs in --item-catalog (JSON Lines, Parquet) and in catalog updates are codes, one "
        "per level: code k of level l is the vocabulary token TEMPLATE[l] with k for {}, e.g. "
        "'<s_a_{}>,<s_b_{}>,<s_c_{}>' (OpenOneRec's three levels). A code whose token the vocabulary lacks "
        "is a start-up error naming it (a 400 in an update). The binary .npz bundle holds token ids; "
        "answers give semantic IDs as token ids.")
    semantic_id_codebooks: str | None = _arg(
        None, "Codebooks written by `python -m sgrec.catalog sid-train`: an item upserted with an `embedding` "
        "and no `semantic_id` gets, level by level, the token of the nearest codeword to the residual (what "
        "sid-assign gives it); the update's answer lists them under `assigned`. Their levels must be the "
        "catalog's semantic-ID length and their tokens the model's.")
    catalog_history: int = _arg(
        8, "Catalog versions kept for POST /v1/catalog/rollback (the current one included); versions share "
        "the catalog's storage, each costs what its update changed.", at_least=1)
    admin_api_key: str | None = _arg(
        None, "Require 'Authorization: Bearer KEY' on the catalog update routes (default: --api-key when set).")
    item_cache_tokens: int | None = _arg(
        None, "KV tokens reserved for the item store (default: enough for the whole catalog, capped at "
        "half the pool); items beyond it are recomputed on a miss.", at_least=0)
    rank_prefix_policy: str = _arg(
        "auto", "Prefix choice of rank requests that do not set one: auto (BAT's hotness rule), user, "
        "item, none (recompute), greedy (the longer side becomes the prefix).",
        ["auto", "user", "item", "none", "greedy"])
    max_rank_candidates: int = _arg(1000, "Most candidate items in one rank request.", at_least=1)
    max_beam_width: int = _arg(512, "Largest beam_width of a retrieve request.", at_least=1)
    max_filter_items: int = _arg(
        100000, "Most item ids in one request's exclude_items or include_items (rank, retrieve, beam /generate).", at_least=1)
    max_batch_tokens: int | None = _arg(
        None, "Concurrent execution (xGR): token capacity of one batch of rank or retrieve requests; a batch "
        "is dispatched once the next request would not fit (1: every request runs alone). Default: 16384, "
        "and on CUDA at least 4 x --chunked-prefill-size (32768 on an H100 or H200: four 5000-token "
        "retrieve prompts with 256 beams in one round).", at_least=1)
    batch_wait_ms: float | None = _arg(
        None, "Longest wait of a batch's oldest request before the batch is dispatched unfilled (default: "
        "derived per kind from --slo-ms as (SLO - 2 x measured batch time) / 2, else 2 ms).", at_least=0)
    slo_ms: float | None = _arg(
        None, "Latency target per request; sets the batching wait quota when --batch-wait-ms is not given.", above=0)
    interleave_rounds: bool = _arg(
        False, "Keep several rank / retrieve batches under way on one stream: each scheduler step advances "
        "every batch under way by one phase (a retrieve round's prefill, each beam level) and starts the "
        "batches that fell due, so a batch starts without waiting for the rounds under way to end and a "
        "generation step can run between two phases. Off: each batch runs whole in one step, and the "
        "requests that arrive meanwhile join the next batch. With --num-streams > 1 on a GPU, batches run "
        "whole on the streams either way.")
    stream_pool_mb: float = _arg(
        64.0, "Per-stream tensor pool of the multi-stream executor: once a stream's pool holds more than "
        "this many MB, tensors whose recorded event has completed are released.", at_least=0)
    num_streams: int = _arg(
        4, "Streams of the multi-stream executor running rank / retrieve batches (CUDA streams when > 1 on a "
        "GPU; on CPU the inline executor uses one).", at_least=1)
    max_request_bytes: int = _arg(16 << 20, "Largest HTTP request body in bytes; larger ones get a 413.", at_least=1)
    max_batch_size: int = _arg(
        1024, "Most prompts in one batch /generate request, and most items in one score request (more: 400).", at_least=1)
    max_n: int = _arg(64, "Largest n (samples per prompt) of a generate request (more: 400).", at_least=1)
    disable_radix_cache: bool = _arg(False, "Disable prefix reuse.")
    attention_backend: str = _arg(
        "auto", "Attention implementation. auto: on CPU native where the CPU reports AVX-512 (where it was "
        "measured faster) and a C compiler builds it (bfloat16 prefill stays on torch's SDPA), else torch; "
        "on CUDA triton where the triton package imports and its decode kernel passes a start-up check "
        "(flashinfer over it where that imports and passes its own), else torch. "
        "torch: SDPA over gathered K/V "
        "(CPU and CUDA); native: sgrec's C kernels on CPU (built with the machine's C compiler on first "
        "use for the CPU's vector ISA): decode and prefill/extend attention reading cached K/V from the "
        "KV pool by slot index, causal and rank (bipartite) masks from two integers per KV column, "
        "tiles nobody sees skipped; other masks as torch; triton: Triton kernels for decode (reading the KV pool by "
        "slot index), beam steps' staged attention, rank forwards' bipartite masks and retrieve levels' "
        "selection (CUDA, or CPU under TRITON_INTERPRET=1 for tests); flashinfer: triton, with decode and "
        "causal prefill through FlashInfer's paged kernels (CUDA, bfloat16/float16 pools; pip install 'sgrec[gpu]').",
        ["auto", "torch", "native", "triton", "flashinfer"])
    disable_cuda_graph: bool = _arg(
        False, "On CUDA, run decode and beam steps without CUDA graphs (by default each decode batch-size "
        "bucket's step is captured once at start-up, each beam step's (rows bucket, step) on first use, and "
        "replayed; needs the triton attention backend).")
    cuda_graph_max_bs: int | None = _arg(
        None, "Largest decode batch replayed from a CUDA graph (default: --max-running-requests, at most "
        "256); larger batches run without one.", at_least=1)
    cuda_graph_max_beams: int = _arg(
        1024, "Most beam rows (of all requests of a retrieve round) in a beam step replayed from a CUDA graph "
        "(on CUDA with the triton backend; each (bucket of rows, step) is captured on first use); larger "
        "steps run without one.", at_least=1)
    disable_weight_packing: bool = _arg(
        False, "On CPU, do not prepack float32 (or natively multiplied bfloat16) weights for oneDNN "
        "matmuls (packing is the default: faster decode; float32 logprobs differ from HF transformers by up "
        "to ~1e-3, within the 2e-3 agreement of ARCHITECTURE.md).")
    disable_fused_decode: bool = _arg(
        False, "On CPU with sgrec's C kernels, do not run small decode batches as one C call per step (every "
        "layer, the final norm and the output layer; on by default: bfloat16 batches of up to 8 sequences "
        "where the CPU has avx512_bf16, float32 batches of up to 2 on AVX-512 (or AVX2 + FMA builds), each "
        "faster than the layer-by-layer step (docs/performance.md); keeps a plain copy of the projection "
        "weights beside the packed one). Its products sum in another order than oneDNN's (within the dtype's rounding, "
        "as any other implementation).")
    quantization: str | None = _arg(
        None, "SGLang's flag. fp8: the decoder layers' linear layers in FP8 (float8_e4m3fn weights with one "
        "scale per output channel, taken from the checkpoint at load; activations quantized per token on "
        "every call by a Triton kernel; cuBLASLt's FP8 GEMM); the output layer stays in --dtype. Needs a CUDA "
        "GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper) and triton; elsewhere a "
        "start-up error says why.", [None, "fp8"])
    kv_cache_dtype: str = _arg(
        "auto", "SGLang's flag. KV pool dtype: auto (the model's dtype) or fp8_e4m3 (float8_e4m3fn, scale 1 as "
        "SGLang's default, values saturated at +-448: half of bf16's bytes a token, so twice the tokens in the "
        "same memory; the kernels read it in float32). Needs a CUDA GPU with FP8 support (compute capability "
        "8.9 or newer); elsewhere, and with --enable-deterministic-inference, a start-up error says why.",
        ["auto", "fp8_e4m3"])
    enable_deterministic_inference: bool = _arg(
        False, "SGLang's flag: a request gets bit-identical outputs whatever else is batched with it, however "
        "many requests run concurrently, however its prefill is chunked and whether its prefix or its items "
        "came from a cache (greedy generate, score, rank, retrieve, recommend; float32 and bfloat16). On CPU: "
        "sgrec's C attention kernels (any vector ISA; needs a C compiler) with every extend summing each "
        "row's visible columns in layout order in an exact two-pass softmax, and every linear layer prepacked "
        "and checked at start-up to give a row the same bits at any row count (one row per matmul where not). "
        "On CUDA (attention backend auto or triton; torch and flashinfer are refused): the triton backend's "
        "batch-invariant kernel, each row's columns tiled at fixed places of the list of columns it sees, CUDA "
        "graphs off, linear layers checked as on CPU (run on an H200). Off by default, for what it costs on "
        "rank, retrieve and saturated serving (docs/performance.md). Candidate order never changes rank "
        "scores, with or without it.")
    random_seed: int = _arg(0, "Seed of the shared sampling generator.")
    dp_size: int = _arg(1, "Data-parallel ranks: one scheduler process (own model, KV pool, caches) each.", at_least=1)
    cpu_threads: int | None = _arg(
        None, "Threads of each scheduler's forward on CPU (torch's intra-op threads). Default: the CPUs this "
        "process may run on, divided among the --dp-size ranks. On a machine with few cores, fewer threads "
        "than cores leave one to the HTTP process and its clients, which can help retrieve traffic there "
        "(docs/performance.md); the default stays all of them, which big prefills and batches use.", at_least=1)
    catalog_update_cores: int = _arg(
        1, "Threads the forward on CPU leaves to catalog updates while they arrive (from an update request, "
        "accepted or not, until 2 s after the last one; at least one thread stays): the HTTP process parses and "
        "validates the bodies and a thread builds each version beside the steps (its effect on retrieve "
        "latency under updates: docs/performance.md). 0: the forward keeps every thread, as it does on a GPU "
        "and under --enable-deterministic-inference (whose check of the linear layers ran at the start-up "
        "thread count).", at_least=0)
    api_key: str | None = _arg(None, "Require 'Authorization: Bearer KEY' on every route but health and metrics.")
    enable_metrics: bool = _arg(False, "Serve Prometheus metrics at /metrics.")
    log_level: str = _arg("info", "Log level.", ["debug", "info", "warning", "error"])
    timeout_keep_alive: float = _arg(
        20.0, "Seconds an idle keep-alive HTTP connection stays open (uvicorn's timeout_keep_alive; SGLang's "
        "SGLANG_TIMEOUT_KEEP_ALIVE, 5 there). Longer than the 5 s after which httpx (and the openai client) "
        "drop an idle pooled connection, so such a client never sends on a connection the server is closing.", above=0)

    def __post_init__(self) -> None:
        if self.chunked_prefill_size is not None and (self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1):
            raise ValueError("chunked_prefill_size must be positive or -1")
        for f in dataclasses.fields(self):
            error = _out_of_range(f.name, getattr(self, f.name), f.metadata.get("bounds", {}))
            if error is not None:
                raise ValueError(error)
        if self.batch_wait_ms is not None and self.slo_ms is not None and self.batch_wait_ms >= self.slo_ms:
            raise ValueError("batch_wait_ms must be below slo_ms (the wait alone would miss the SLO)")
        self._check_hicache()
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"Unknown {f.name} {getattr(self, f.name)!r}; choose one of {choices}")

    def _check_hicache(self) -> None:
        self.hicache_extra_config()
        if not self.enable_hierarchical_cache and (self.hicache_storage_backend or self.hicache_ratio or self.hicache_size):
            raise ValueError("hicache_ratio, hicache_size and hicache_storage_backend need enable_hierarchical_cache")

    def forward_threads(self) -> int:
        """--cpu-threads, or the CPUs this process may run on (its affinity: a container's cpuset, taskset)
        divided among the DP ranks."""
        if self.cpu_threads is not None:
            return self.cpu_threads
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cpus // self.dp_size)

    def hicache_extra_config(self) -> dict:
        """--hicache-storage-backend-extra-config as a dict (ValueError naming the flag when it is not a JSON object
        of known keys)."""
        import json

        if not self.hicache_storage_backend_extra_config:
            return {}
        try:
            extra = json.loads(self.hicache_storage_backend_extra_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"hicache_storage_backend_extra_config is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("hicache_storage_backend_extra_config must be a JSON object")
        unknown = sorted(set(extra) - HICACHE_EXTRA_KEYS)
        if unknown:
            raise ValueError(f"hicache_storage_backend_extra_config: unknown key(s) {unknown}; known: {sorted(HICACHE_EXTRA_KEYS)}")
        for k in ("prefetch_timeout_base", "prefetch_timeout_per_ki_token"):
            if k in extra and (not isinstance(extra[k], (int, float)) or extra[k] < 0):
                raise ValueError(f"hicache_storage_backend_extra_config: {k} must be a non-negative number")
        if extra.get("item_reads", "cost") not in ("cost", "always"):
            raise ValueError("hicache_storage_backend_extra_config: item_reads must be cost or always")
        return extra

    @property
    def prefill_chunk(self) -> int:
        """The most prompt tokens one prefill forward takes (--chunked-prefill-size once sized_for
        filled it in; -1, no chunking: no bound)."""
        chunk = self.chunked_prefill_size
        if chunk is None:
            raise ValueError("chunked_prefill_size is left to the device: call sized_for first")
        return chunk if chunk > 0 else 1 << 62

    def sized_for(self, device_type: str, device_memory: int | None = None) -> "ServerArgs":
        """These arguments with the sizes left to the device filled in (chunked_prefill_size,
        max_batch_tokens; see their help), device_memory the GPU's total bytes on CUDA. Idempotent."""
        chunk, batch = self.chunked_prefill_size, self.max_batch_tokens
        if chunk is None:
            gib = (device_memory or 0) / 2**30 if device_type == "cuda" else 0
            chunk = 16384 if gib >= 160 else 8192 if gib >= 35 else 2048
        if batch is None:
            batch = max(DEFAULT_BATCH_TOKENS, 4 * chunk) if device_type == "cuda" else DEFAULT_BATCH_TOKENS
        if (chunk, batch) == (self.chunked_prefill_size, self.max_batch_tokens):
            return self
        return dataclasses.replace(self, chunked_prefill_size=chunk, max_batch_tokens=batch)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"Unknown server argument(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata["help"]
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=help_text)
                continue
            typ = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
            default = f.default
            shown = "" if default is None else f" (default: {default})"
            parser.add_argument(flag, type=typ, default=default, choices=f.metadata.get("choices"),
                                help=help_text + shown)

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> "ServerArgs":
        parser = argparse.ArgumentParser(
            prog="python -m sgrec.launch_server",
            description="Serve a model with sgrec (SGLang-compatible native and OpenAI APIs).",
        )
        cls.add_cli_args(parser)
        for flag, why in RETIRED.items():
            parser.add_argument(flag, help=argparse.SUPPRESS, action=_Retired, why=why)
        ns = parser.parse_args(argv)
        try:
            return cls(**vars(ns))
        except ValueError as e:
            parser.error(str(e))

    @property
    def journal_path(self) -> str | None:
        """The catalog journal's path (None without a catalog)."""
        if self.catalog_journal is not None:
            return self.catalog_journal
        return None if self.item_catalog is None else default_journal_path(self.item_catalog)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Retired(argparse.Action):
    """A flag that no longer exists: parsing it is an error naming what replaced it."""

    def __init__(self, option_strings, dest, why: str, **kw):
        super().__init__(option_strings, argparse.SUPPRESS, **kw)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was retired: {self.why}")


PACKAGE_DIR = os.path.dirname(os.path.realpath(__file__))  # the installed sgrec package: never written


def cache_dir() -> str:
    """Where sgrec caches what it can rebuild (the built CPU kernels, prepared models, fetched wheels):
    $SGREC_CACHE_DIR, else $XDG_CACHE_HOME/sgrec (default ~/.cache/sgrec)."""
    if os.environ.get("SGREC_CACHE_DIR"):
        return os.environ["SGREC_CACHE_DIR"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "sgrec")


def state_dir() -> str:
    """Where sgrec keeps mutable state of its own: $XDG_STATE_HOME/sgrec (default ~/.local/state/sgrec)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "sgrec")


def default_journal_path(catalog_path: str) -> str:
    """`<catalog>.journal`, beside the catalog file; for a catalog inside the installed package (the
    embedded demo's) the same name under state_dir(), so updates never write into the install."""
    real = os.path.realpath(catalog_path)
    if os.path.commonpath([real, PACKAGE_DIR]) == PACKAGE_DIR:
        return os.path.join(state_dir(), os.path.relpath(real, PACKAGE_DIR) + ".journal")
    return catalog_path + ".journal"
