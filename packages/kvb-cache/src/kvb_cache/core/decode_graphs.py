"""Decode steps replayed from CUDA graphs instead of launched op by op.

A decode step of a small model is bound by the host: every layer dispatches dozens of small kernels, and the
Python and dispatcher work to launch them takes longer than the GPU takes to run them (an H200 measured a
SmolLM2-135M step at ~27 ms of host time for well under 5 ms of kernels, docs/server.md). A CUDA graph records
one step's launches once and replays them with a single call. vLLM and nano-vllm do the same; transformers'
continuous batching captures graphs too.

A graph replays fixed shapes and fixed memory, so a decode-only step (every scheduled request feeds one token
and samples) is padded to a bucket: ``rows`` up to the next of :func:`row_buckets`, the padded context width
up to the next of :func:`width_buckets`. Each bucket has its own static inputs: the token, position and
context length of each row ``[3, rows]``, and each row's context slots ``[rows, width]``. Everything else the
step needs (the pool slot each new key is written to, the block tables, the position mask) is computed from
them inside the graph. Padding rows feed token 0 at position 0 with a context of one slot, the storage's
scratch slot, which no request owns, so they write and read nothing anyone else sees. Steps with a prefill,
a speculative verification (several tokens) or more rows than the largest bucket run eagerly as before.

What is captured is :class:`ModelRunner`'s own forward over the same attention functions, so a replay
computes what an eager step does up to rounding: the padding rows change the row count a matmul (or an MoE
expert) sums over, which may change its blocking (fp32: within 1e-5 on dense models, 1.7e-5 on gpt-oss in
the CPU tests; bf16 greedy text can part at near-ties, as it does between batch sizes anyway). A model whose forward cannot be captured (a
host read of a tensor inside it, a data-dependent shape: some MoE routers) fails its first capture; that is
logged once and every later step runs eagerly; so does a model with forward hooks (a replay would skip
them). A bucket whose capture runs out of memory runs eagerly alone. Buckets are captured lazily, at their
first step: that step pays the capture (a warm-up forward and the recording).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedModel

from kvb_cache.core.kv_storage import KVStorage
from kvb_cache.core.paged_attention import no_mask, paged_call
from kvb_cache.core.paged_batch import DecodeGroup, PagedBatch
from kvb_cache.core.pool_kernel import PoolKernel

logger = logging.getLogger(__name__)

#: Narrowest padded context a graph is captured for (shorter contexts share it).
MIN_WIDTH = 256

#: Turns a step function (no arguments, returns ``[rows, V]`` logits computed from static inputs) into a
#: replay function returning the same tensor refreshed. :func:`cuda_capture` records a CUDA graph; tests on
#: CPU pass ``lambda fn: fn`` (every replay re-runs the function over the same static inputs).
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Batch sizes graphs are captured for: powers of two below ``max_rows``, then ``max_rows``."""
    sizes = []
    size = 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return (*sizes, max_rows)


def width_buckets(max_width: int, block_size: int) -> tuple[int, ...]:
    """Padded context widths: :data:`MIN_WIDTH` doubling up to ``max_width``, each a multiple of
    ``block_size`` (so a row's block table covers its width exactly)."""
    top = -(-max_width // block_size) * block_size
    sizes = []
    size = -(-MIN_WIDTH // block_size) * block_size
    while size < top:
        sizes.append(size)
        size *= 2
    return (*sizes, top)


def bucket(sizes: Sequence[int], n: int) -> int | None:
    """The smallest of ``sizes`` (ascending) holding ``n``; None when none does."""
    return next((s for s in sizes if s >= n), None)


def cuda_capture(device: torch.device) -> Capture:
    """A :data:`Capture` recording CUDA graphs on ``device`` on a capture stream of its own, all into one
    memory pool: graphs of different buckets never run at once, and what each leaves behind (its output) is
    read before the next replay, so their transients may share memory.

    ``capture_begin`` / ``capture_end`` are driven here rather than through ``torch.cuda.graph``: that
    context manager captures on one process-wide stream made on whichever device was current first (a
    second GPU's engine then records an empty graph), and when ``capture_end`` raises (a forward that reads
    the device invalidates the capture) it never restores the caller's stream, so every later eager step
    would run on the capture stream.
    """
    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device)

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        current = torch.cuda.current_stream(device)
        # As torch.cuda.graph does: the blocks the eager steps left cached go back to the driver first, so
        # that they do not stack with what the capture stream and the graph pool take (on an H200 the
        # process's reserved peak rose ~300 MiB at the first capture without it: 107-152 MiB over a
        # gpu_memory_utilization share; docs/server.md).
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        # One eager run on the capture stream first (as torch's docs ask): Triton autotuning, cuBLAS
        # workspaces and lazy initialisations happen there, not inside the capture. It writes the step's
        # real keys and values into their slots; the replay writes the same values again.
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                fn()
                # thread_local: another thread's CUDA calls (a server's tier writer) cannot invalidate it.
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    out = fn()
                finally:
                    graph.capture_end()
        finally:
            current.wait_stream(stream)
            # The warm-up's blocks are cached for the capture stream, which only a later warm-up can reuse.
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


class DecodeGraphs:
    """Runs decode-only steps through captured graphs (see the module docstring).

    Args:
        model: the model with ``kvb_paged`` attention installed.
        storage: the pool; its :attr:`~KVStorage.scratch_slot` takes the padding rows' keys/values.
        kernel: the pool attention kernel the eager steps use, or None (gather + SDPA).
        max_rows: most rows of a captured step (the scheduler's ``max_num_seqs``).
        max_width: the longest context a row can have (the pool's tokens or ``max_model_len``).
        capture: how a step function becomes a replay (:func:`cuda_capture` on CUDA).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        storage: KVStorage,
        *,
        kernel: PoolKernel | None,
        max_rows: int,
        max_width: int,
        capture: Capture,
    ) -> None:
        if storage.scratch_slot is None:
            raise ValueError("decode graphs need a KVStorage with a scratch block (scratch=True)")
        self.model = model
        self.storage = storage
        self.kernel = kernel
        self.capture = capture
        self.device = storage.keys[0].device
        self.rows = row_buckets(max_rows)
        self.widths = width_buckets(max_width, storage.block_size)
        cuda = self.device.type == "cuda"
        # Static inputs shared by every bucket (one replays at a time; a bucket of r rows reads the first r):
        # token, position and context length per row, staged on the host (pinned on CUDA) and copied in one
        # transfer; and per width bucket each row's context slots, stale past its length.
        self._ints = torch.zeros((3, max_rows), dtype=torch.long, device=self.device)
        host = torch.zeros((3, max_rows), dtype=torch.long)
        self._host = host.pin_memory() if cuda else host
        self._copied = torch.cuda.Event() if cuda else None
        self._slots: dict[int, torch.Tensor] = {}
        self._replays: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        #: Buckets that failed to capture for want of memory: they run eagerly, the others keep replaying.
        self._eager: set[tuple[int, int]] = set()
        self._scratch = torch.tensor([storage.scratch_slot], device=self.device)
        # Every bucket's logits land in this one buffer ([max_rows, V], made by the first step): a graph's
        # own output would stay allocated for as long as the graph, one [rows, V] per bucket.
        self._logits: torch.Tensor | None = None
        #: Why capturing failed (every step then runs eagerly); None while graphs work.
        self.disabled: str | None = None
        #: Steps served by a replay, and graphs captured (stats and tests).
        self.replays = 0
        self.captures = 0

    def stats(self) -> dict[str, int | str | None]:
        """Graphs captured, steps replayed, and why capturing failed (None while graphs work)."""
        return {"captures": self.captures, "replays": self.replays, "disabled": self.disabled}

    def serves(self, token_counts: Sequence[int], starts: Sequence[int], samples: Sequence[bool]) -> bool:
        """Whether a step of these rows is decode-only and fits a bucket."""
        return (
            self.disabled is None
            and 0 < len(token_counts) <= self.rows[-1]
            and all(q == 1 for q in token_counts)
            and all(s > 0 for s in starts)
            and all(samples)
            and max(starts) + 1 <= self.widths[-1]
        )

    def forward(
        self, token_ids: Sequence[int], starts: Sequence[int], slots: Sequence[torch.Tensor]
    ) -> torch.Tensor | None:
        """``[B, V]`` logits of a decode-only step (row ``i`` feeds ``token_ids[i]`` at position ``starts[i]``
        over context slots ``slots[i]`` ``[starts[i] + 1]``), or None when this step must run eagerly (its
        bucket, or this model, failed to capture)."""
        n = len(token_ids)
        rows = bucket(self.rows, n)
        width = bucket(self.widths, max(starts) + 1)
        assert rows is not None and width is not None, "serves() was not asked first"
        key = (rows, width)
        if key in self._eager:
            return None
        self._fill(token_ids, starts, slots, rows, width)
        replay = self._replays.get(key)
        if replay is None:
            replay = self._capture(key)
            if replay is None:
                return None
        logits = replay()
        self.replays += 1
        # A copy: the next replay overwrites the shared buffer.
        return logits[:n].clone()

    def _capture(self, key: tuple[int, int]) -> Callable[[], torch.Tensor] | None:
        rows, width = key
        if _hooked(self.model):
            return self._disable("the model has forward hooks, which a graph would not run")
        try:
            replay = self.capture(lambda: self._step(rows, width))
        except torch.OutOfMemoryError as exc:
            # This bucket only (the largest ones need the most): the others keep their graphs.
            self._eager.add(key)
            logger.warning("decode steps of %d rows x %d positions run eagerly: %s", rows, width, exc)
            return None
        except Exception as exc:  # a forward that cannot be captured: this model runs eagerly
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return self._disable(f"capturing failed ({type(exc).__name__}: {first})")
        self._replays[key] = replay
        self.captures += 1
        return replay

    def _disable(self, why: str) -> None:
        self.disabled = why
        self._replays.clear()
        self._slots.clear()
        self._logits = None
        logger.warning("decode steps of %s run eagerly from now on: %s", type(self.model).__name__, why)
        return None

    def _fill(
        self,
        token_ids: Sequence[int],
        starts: Sequence[int],
        slots: Sequence[torch.Tensor],
        rows: int,
        width: int,
    ) -> None:
        n = len(token_ids)
        pad = rows - n
        if self._copied is not None:
            # The previous step's copy out of the pinned buffer must be done before it is overwritten.
            self._copied.synchronize()
        # Padding rows: token 0 at position 0, one slot of context (the scratch slot).
        self._host[:, :rows].copy_(
            torch.tensor(
                [[*token_ids, *[0] * pad], [*starts, *[0] * pad], [s + 1 for s in starts] + [1] * pad]
            )
        )
        self._ints[:, :rows].copy_(self._host[:, :rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        table = self._slots.get(width)
        if table is None:
            table = self._slots[width] = torch.full(
                (self.rows[-1], width), self.storage.scratch_slot, dtype=torch.long, device=self.device
            )
        padded = pad_sequence([*slots, *[self._scratch] * pad], batch_first=True)  # [rows, longest]
        table[:rows, : padded.shape[1]].copy_(padded)

    def _step(self, rows: int, width: int) -> torch.Tensor:
        """The captured step: ``[rows, V]`` logits from the static inputs of bucket ``(rows, width)``."""
        ids, positions, lengths = self._ints[0, :rows], self._ints[1, :rows], self._ints[2, :rows]
        slots = self._slots[width][:rows]
        block_size = None if self.kernel is None else self.storage.block_size
        group = DecodeGroup.padded(slots, lengths, block_size=block_size, row_start=0)
        batch = PagedBatch(
            storage=self.storage,
            slot_mapping=slots.gather(1, positions.unsqueeze(1)).squeeze(1),
            prefills=(),
            decode=group,
            kernel=self.kernel,
        )
        with paged_call(batch):
            out = self.model(
                input_ids=ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                attention_mask=no_mask(self.device),
                use_cache=False,
            )
        logits = out.logits[0]  # [rows, V]
        if self._logits is None:
            self._logits = logits.new_empty((self.rows[-1], logits.shape[-1]))
        self._logits[:rows].copy_(logits)
        return self._logits[:rows]


def _hooked(model: torch.nn.Module) -> bool:
    """Whether running ``model`` runs Python hooks a replay would skip (forward hooks, accelerate's
    dispatch hooks): state they keep or work they do (moving offloaded weights) would be frozen."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in model.modules())
