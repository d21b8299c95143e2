"""ModelRunner: owns the model, its memory and the attention backend; the one door the paths use.

The paths (scheduler, rank, beam, items) reach the model and its memory only through the runner:
a forward (`forward`, `hidden`, `forward_with` for a path's own backend), logits
(`compute_logits`), the memory object (`memory`: token slots, KV, state slots, bytes per token)
and the family's capabilities (`capabilities`, `kernels`), never the model's layers or the pool's
internals.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

from sgrec.mem.kv_pool import FP8, KVPool
from sgrec.mem.memory import Memory, StatePool
from sgrec.model import families
from sgrec.model.attention import AttentionBackend, ForwardBatch, NativeBackend, SeqLayout, TritonBackend
from sgrec.model.backends import make_backend
from sgrec.model.config import ModelConfig, resolve_dtype
from sgrec.model.cpu_linear import packing_available
from sgrec.model.fused_decode import FusedDecode
from sgrec.model.loader import load_model
from sgrec.server_args import ServerArgs

logger = logging.getLogger(__name__)

CPU_MEM_FRACTION = 0.1  # of available RAM, when neither max_total_tokens nor mem_fraction_static is set
CPU_MAX_TOKENS = 1 << 17
CUDA_MEM_FRACTION = 0.85
CUDA_GRAPH_MAX_BS = 256  # the default largest decode batch replayed from a CUDA graph
STATE_MEMORY_SHARE = 0.5  # at most this share of the memory share goes to state slots, by default


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"Unknown device {device!r} (auto, cpu, cuda)")
    return torch.device(device)


def check_quantization(args: ServerArgs, device: torch.device) -> None:
    """--quantization fp8 and --kv-cache-dtype fp8_e4m3 where they cannot run: a start-up error saying why."""
    from sgrec.model.fp8 import fp8_unsupported

    for flag, on in ((f"--quantization {args.quantization}", args.quantization is not None),
                     (f"--kv-cache-dtype {args.kv_cache_dtype}", args.kv_cache_dtype != "auto")):
        if not on:
            continue
        why = fp8_unsupported(device)
        if why is None and flag.startswith("--quantization") and importlib.util.find_spec("triton") is None:
            why = "its activation kernel needs the triton package"
        if why is None and args.enable_deterministic_inference:
            why = "--enable-deterministic-inference is not checked with FP8; leave one of the two out"
        if why is not None:
            raise ValueError(f"{flag}: {why}")


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


@dataclass(frozen=True)
class BeamStepPlan:
    """How a beam step runs on this runner (`ModelRunner.beam_plan`); the beam executor builds its
    staged attention and graphs from it and never tests the backend itself.

    staged: the staged attention's kernels: "triton" (every request's stages in one launch),
    "native" (sgrec's C extend kernel, each request's beams one block of a bipartite layout) or
    "torch" (the staged matmuls). deterministic: the runner's batch-invariant kernels, which every
    step goes through. device_select: each level's selection in the Triton trie step, on the
    device. graphs: device rounds replayed from CUDA graphs. trie_on_device: the catalog trie's
    beam-step arrays on the runner's device (a LayeredTrie's `device`: what the Triton trie step
    reads, and a GPU's torch step), else read on the host."""

    staged: str
    deterministic: bool
    device_select: bool
    graphs: bool
    trie_on_device: bool


@contextlib.contextmanager
def denormals_flushed():
    """Denormal floats flushed to zero on the calling thread and its OpenMP team (the threads torch's
    CPU ops started from it run on) for the block, the mode before restored after: a family with
    recurrent layers, whose delta rule's decays underflow into denormals, which x86 multiplies tens of
    times slower. Through the C kernels, which reach the team; without them torch.set_flush_denormal,
    which sets the calling thread only (logged once) and is turned off after."""
    from sgrec.model import native

    lib = native.load()
    if lib is None:
        if not _warned_denormals:
            _warned_denormals.append(True)
            logger.warning("denormal floats flushed on the calling thread only (no C kernels): the recurrent "
                           "layers may run much slower where their decays underflow")
        torch.set_flush_denormal(True)
        try:
            yield
        finally:
            torch.set_flush_denormal(False)
        return
    before = native.flush_denormals(True, lib)
    try:
        yield
    finally:
        if before is False:
            native.flush_denormals(False, lib)


_warned_denormals: list[bool] = []


class ModelRunner:
    def __init__(self, args: ServerArgs, show_progress: bool = False):
        if not args.model_path or not os.path.isdir(args.model_path):
            raise ValueError(f"model_path {args.model_path!r} is not a directory")
        self.device = resolve_device(args.device)
        on_gpu = self.device.type == "cuda"
        self.device_memory = torch.cuda.get_device_properties(self.device).total_memory if on_gpu else None
        self.args = args = args.sized_for(self.device.type, self.device_memory)  # chunk and batch sizes by device
        self.config = ModelConfig.from_dir(args.model_path)
        self.family = families.family_named(self.config.family)
        self.capabilities = self.family.capabilities(self.config)
        self.dtype = resolve_dtype(args.dtype, self.config, self.device)
        self.context_len = args.context_length or self.config.max_position_embeddings
        torch.manual_seed(args.random_seed)
        self.packed = not args.disable_weight_packing and packing_available(self.device, self.dtype)
        det = args.enable_deterministic_inference
        check_quantization(args, self.device)
        self.kv_dtype = FP8 if args.kv_cache_dtype == "fp8_e4m3" else self.dtype  # the KV pool's
        self.backend = make_backend(args.attention_backend, self.device, deterministic=det)
        # the fused decode step and the decode graphs run only for families that declare them
        fused = self._fused_decode_lib() if self.capabilities.fused_decode else None
        self.model = load_model(args.model_path, self.config, self.device, self.dtype, show_progress, self.packed, det,
                                args.quantization, keep_plain=fused is not None)
        self.fused = None if fused is None else FusedDecode(self.model, fused)
        if isinstance(self.backend, NativeBackend):  # sgrec's C kernels: attention, and the float32 glue
            from sgrec.model import native

            self.model.use_glue(native)
        elif isinstance(self.backend, TritonBackend) and self.device.type == "cuda":  # Triton's, on CUDA
            from sgrec.model.kernels import glue

            self.model.use_glue(glue)
        # a family with recurrent layers on CPU: its forwards flush denormals (denormals_flushed)
        self._flush = bool(self.capabilities.state_shapes) and self.device.type == "cpu"
        self.max_input_len = min(args.max_input_len or self.context_len - 1, self.context_len - 1)
        self.memory = self._new_memory(1)
        reserve = self.profile_peak_bytes(self.max_input_len) if args.max_input_len else 0
        self.memory = self._new_memory(self._pool_size(reserve))
        logger.info("KV pool: %d tokens, dtype %s, device %s%s", self.memory.size, self.dtype, self.device,
                    ", oneDNN weight packing on" if self.packed else "")
        self.graphs = self._decode_graphs() if self.capabilities.decode_graphs else None

    def _fused_decode_lib(self):
        """The C kernels' library where decode batches of up to fused_decode.MAX_BATCH run as one call
        (sgrec.model.fused_decode: on CPU through the C kernels, bf16 where they are built with avx512_bf16,
        float32 where built for AVX2 + FMA or AVX-512), else None: --disable-fused-decode,
        --enable-deterministic-inference, --quantization, another backend, or a dtype the build does not run."""
        args = self.args
        if (args.disable_fused_decode or args.enable_deterministic_inference or args.quantization is not None
                or not isinstance(self.backend, NativeBackend)):
            return None
        from sgrec.model import fused_decode, native

        lib = native.load()
        return lib if fused_decode.available(self.device, self.dtype, lib) else None

    def _decode_graphs(self):
        """Decode steps replayed from CUDA graphs (sgrec.model.cuda_graph) on CUDA with the triton
        backend, unless --disable-cuda-graph. A capture that runs out of memory is logged, and decode
        runs eagerly; any other failure is raised (cuda_graph.try_capture)."""
        args = self.args
        if (self.device.type != "cuda" or args.disable_cuda_graph or not isinstance(self.backend, TritonBackend)
                or self.backend.deterministic):  # the batch-invariant kernel reads a meta built per step
            return None
        from sgrec.model.cuda_graph import DecodeGraphs, try_capture

        max_bs = min(args.cuda_graph_max_bs or CUDA_GRAPH_MAX_BS, args.max_running_requests)
        return try_capture(lambda: DecodeGraphs(self.model, self.backend, self.kv_pool, max_bs, 2 * self.kv_pool.size,
                                                self.context_len, capture=True), "decode runs without graphs")

    @property
    def kv_pool(self) -> KVPool:
        """The attention layers' KV (what ForwardBatch and the attention backends read)."""
        return self.memory.kv

    @property
    def kernels(self) -> str:
        """Which kernels the attention backend runs: "triton" (--attention-backend triton, and
        flashinfer over it), "native" (sgrec's C kernels) or "torch"; for paths choosing their own
        kernels of the same kind (the beam's staged attention)."""
        if isinstance(self.backend, TritonBackend):
            return "triton"
        return "native" if isinstance(self.backend, NativeBackend) else "torch"

    @property
    def deterministic(self) -> bool:
        """--enable-deterministic-inference: every forward through the batch-invariant kernels."""
        return self.backend.deterministic

    def beam_plan(self) -> BeamStepPlan:
        """The beam step's kernels on this runner: the staged attention of the runner's own kind of
        kernels; on triton the trie step's selection on the device, and on CUDA, unless
        --disable-cuda-graph or the batch-invariant kernels (whose meta is built per step), its
        rounds from CUDA graphs (not for a family with recurrent layers: the graphs carry no states)."""
        triton = self.kernels == "triton"
        on_gpu = self.device.type == "cuda"
        graphs = triton and on_gpu and not self.deterministic and not self.args.disable_cuda_graph
        caps = self.capabilities  # neither the device round nor its graphs run an encoder-decoder's attention
        return BeamStepPlan(staged=self.kernels, deterministic=self.deterministic,
                            device_select=triton and not caps.encoder,
                            graphs=graphs and not caps.state_shapes and not caps.encoder,
                            trie_on_device=on_gpu or triton)

    def _new_memory(self, size: int) -> Memory:
        """The memory object: `size` token slots for the attention layers and, for a family with
        recurrent layers, its state slots (_state_slots)."""
        cfg, caps = self.config, self.capabilities
        states = self._state_slots() if caps.state_shapes else 0
        return Memory(size, caps.layer_kinds, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype, self.device, self.dtype,
                      states=states, state_shapes=caps.state_shapes, state_float32=caps.state_float32)

    def _state_slots(self) -> int:
        """--max-mamba-cache-size, else one state slot a running request and as many for the radix
        cache's snapshots (none without the cache), within STATE_MEMORY_SHARE of the memory share the
        KV pool is sized from."""
        args = self.args
        if args.max_mamba_cache_size:
            return args.max_mamba_cache_size
        want = args.max_running_requests * (1 if args.disable_radix_cache else 2)
        caps = self.capabilities
        per_state = StatePool(0, caps.state_shapes, self.dtype, "meta", caps.state_float32).bytes_per_state
        fit = int(_available_memory(self.device) * self._memory_fraction() * STATE_MEMORY_SHARE) // per_state
        if fit < want:
            logger.info("state slots: %d (of %d wanted) fit in %.0f%% of the memory share; --max-mamba-cache-size "
                        "sets them", max(fit, 1), want, 100 * STATE_MEMORY_SHARE)
        return max(1, min(want, fit))

    def _memory_fraction(self) -> float:
        on_cpu = self.device.type == "cpu"
        return self.args.mem_fraction_static or (CPU_MEM_FRACTION if on_cpu else CUDA_MEM_FRACTION)

    def profile_peak_bytes(self, n: int) -> int:
        """Peak memory of one prefill-only forward of n tokens, all KV discarded (PrefillOnly §3.1's
        profile run). CUDA: max_memory_allocated; CPU: growth of the peak RSS (an upper bound)."""
        batch = self.make_batch([0] * n, list(range(n)), torch.zeros(n, dtype=torch.int64),
                                [SeqLayout(0, n, torch.zeros(n, dtype=torch.int64))])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            self._profile_forward(batch, n)
            peak = torch.cuda.max_memory_allocated(self.device) - base
        else:
            base = _peak_rss()
            self._profile_forward(batch, n)
            peak = _peak_rss() - base
        logger.info("profile run of %d tokens: peak %.1f MiB", n, peak / 2**20)
        return peak

    def _profile_forward(self, batch: ForwardBatch, n: int) -> None:
        """The profile run's forward: the encoder's over n tokens for an encoder-decoder family
        (its longest input), else a prefill-only one."""
        if self.capabilities.encoder:
            self.encode(batch)
        else:
            self.forward_prefill_only(batch, [n - 1])

    def _pool_size(self, reserve: int = 0) -> int:
        """KV pool tokens: --max-total-tokens, else a share of the memory left after `reserve` bytes
        (the profile run's peak) are set aside for activations and the state slots for theirs."""
        if self.args.max_total_tokens:
            return self.args.max_total_tokens
        per_token = self.memory.bytes_per_token
        on_cpu = self.device.type == "cpu"
        reserve += self.memory.states.size * self.memory.bytes_per_state  # the state slots come first
        size = int(max(_available_memory(self.device) - reserve, 0) * self._memory_fraction()) // per_token
        if on_cpu:
            size = min(size, CPU_MAX_TOKENS)
        if size < 2:
            raise ValueError("Not enough memory for the KV pool; lower --max-input-len or set --max-total-tokens")
        return size

    def make_batch(
        self, input_ids: list[int], positions: list[int], out_cache_loc: torch.Tensor, seqs: list[SeqLayout],
        state_slots: list[torch.Tensor] | None = None, state_parents: list[int] | None = None,
        encoder_slots: list[torch.Tensor] | None = None,
    ) -> ForwardBatch:
        """A forward batch over the runner's memory. state_slots: each sequence's state slot (a
        family with recurrent layers: the state it starts from and leaves), or None (every
        sequence from a zero state, none kept); state_parents: ForwardBatch's; encoder_slots (an
        encoder-decoder family's decoder): each sequence's encoder input slots (`encode`'s)."""
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            out_cache_loc=out_cache_loc.to(dev),
            seqs=seqs,
            kv_pool=self.memory.kv,
            state_slots=None if state_slots is None else torch.cat(state_slots).to(dev),
            state_pool=self.memory.states,
            state_parents=state_parents,
            encoder_slots=encoder_slots,
        )

    def forward(self, batch: ForwardBatch, logit_rows: torch.Tensor | list[int]) -> torch.Tensor:
        """float32 logits [len(logit_rows), vocab] for the asked rows of the flat batch (a decode batch
        that fits: replayed from its bucket's CUDA graph)."""
        if self.graphs is not None and self.graphs.takes(batch):
            rows = torch.as_tensor(logit_rows, dtype=torch.int64, device=self.device)
            return self.graphs.run(batch).index_select(0, rows)
        if self.fused is not None and self.fused.takes(batch, self.backend):
            return self.fused.run(batch).index_select(0, torch.as_tensor(logit_rows, dtype=torch.int64))
        return self.model.compute_logits(self.hidden(batch, logit_rows))

    def encode(self, batch: ForwardBatch) -> torch.Tensor:
        """An encoder-decoder family's encoder over the batch's sequences (each its own input, at
        positions from 0): every token's slot receives each decoder layer's cross-attention K/V,
        read by the decoder batches that name these slots (ForwardBatch.encoder_slots); returns the
        encoder's output."""
        if not self.capabilities.encoder:
            raise ValueError(f"the {self.family.name} family has no encoder")
        with self._fp_mode():
            return self.model.encode(batch)

    @property
    def encoded_inputs(self) -> int:
        """How many inputs the encoder has read since start-up (0 without an encoder)."""
        return getattr(self.model, "encoded_inputs", 0)

    def compute_logits(self, hidden: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of final hidden states: every vocabulary column, or only `columns`."""
        return self.model.compute_logits(hidden, columns)

    def hidden(self, batch: ForwardBatch, rows: torch.Tensor | list[int]) -> torch.Tensor:
        """The final hidden states [len(rows), hidden] of the asked rows (compute_logits makes logits,
        of every column or of some)."""
        return self._model(batch, self.backend, torch.as_tensor(rows, dtype=torch.int64, device=self.device))

    def forward_with(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Final hidden states [T, hidden] of every row, attention through a path's own backend
        (the beam's staged one: its batches carry their own attention meta)."""
        return self._model(batch, backend)

    def _model(self, batch: ForwardBatch, backend: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The model's forward (final hidden states of every row, or of `rows`: a family may skip work
        the other rows alone need), in the floating-point mode the family needs (_fp_mode)."""
        with self._fp_mode():
            return self.model(batch, backend, rows)

    def _fp_mode(self):
        """The floating-point mode a forward of this family runs in: denormals flushed where the
        family needs it (denormals_flushed), else the mode as it is."""
        return denormals_flushed() if self._flush else contextlib.nullcontext()

    def weights(self) -> dict[str, torch.Tensor]:
        """The model's tensors by name (what names the KV it computes: radix/hicache.model_fingerprint)."""
        return self.model.state_dict()

    def reserve_positions(self, n: int) -> None:
        """Positions up to n made ready before any step runs (a step replayed on the device reads
        no position back to grow its tables)."""
        if self.model.rope is not None:  # a family with rotary embeddings
            self.model.rope.reserve(n)

    def forward_prefill_only(self, batch: ForwardBatch, logit_rows: torch.Tensor | list[int]) -> torch.Tensor:
        """Like forward, through hybrid prefilling (MLP and projections chunk by chunk)."""
        return self.model.compute_logits(self.hidden_prefill_only(batch, logit_rows))

    def hidden_prefill_only(self, batch: ForwardBatch, rows: torch.Tensor | list[int]) -> torch.Tensor:
        """Like hidden, through hybrid prefilling where the family's layers take it (else the whole
        forward at once)."""
        if not self.capabilities.hybrid_prefill:
            return self.hidden(batch, rows)
        rows = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        with self._fp_mode():
            return self.model.hybrid_forward(batch, self.backend, self.args.hybrid_chunk_size, rows)
