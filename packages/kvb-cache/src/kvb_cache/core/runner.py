"""The model runner: plain tensors in, logits out. It never sees requests, the scheduler or the engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedModel

from kvb_cache.core.decode_graphs import DecodeGraphs
from kvb_cache.core.kv_storage import KVStorage
from kvb_cache.core.paged_attention import no_mask, paged_call
from kvb_cache.core.paged_batch import DecodeGroup, PagedBatch, PrefillSeq
from kvb_cache.core.pool_kernel import PoolKernel, block_table


@dataclass(frozen=True, slots=True, kw_only=True)
class SeqInput:
    """One request's slice of a step.

    Attributes:
        token_ids: the tokens fed this step (``q`` of them).
        start: position of the first of them (tokens before it already have KV).
        slots: ``[start + q]`` pool slots of the request's whole context, new tokens included.
        sample: whether logits are wanted after the last of them.
        logits: with ``sample``, how many of the last positions' logits are wanted (a speculating
            request's last token and its drafts: one row per draft to verify, plus the next token's).
    """

    token_ids: Sequence[int]
    start: int
    slots: torch.Tensor
    sample: bool
    logits: int = 1


class ModelRunner:
    """Runs one packed forward over the pool for a list of :class:`SeqInput`."""

    def __init__(
        self,
        model: PreTrainedModel,
        storage: KVStorage,
        *,
        logits_to_keep: bool,
        kernel: PoolKernel | None = None,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.storage = storage
        self.logits_to_keep = logits_to_keep
        #: Attention over the pool's blocks in place (None: each context gathered, then SDPA).
        self.kernel = kernel
        #: Decode-only steps replayed from CUDA graphs (None: every step eager; ``enforce_eager``, or no CUDA).
        self.graphs = graphs
        self.device = storage.keys[0].device

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqInput]) -> torch.Tensor:
        """``[R, V]`` logits for the sequences with ``sample`` set, in order (``logits`` rows each)."""
        graphs = self.graphs
        if graphs is not None and graphs.serves(
            [len(s.token_ids) for s in seqs], [s.start for s in seqs], [s.sample for s in seqs]
        ):
            logits = graphs.forward(
                [s.token_ids[0] for s in seqs], [s.start for s in seqs], [s.slots for s in seqs]
            )
            if logits is not None:
                return logits
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        prefills: list[PrefillSeq] = []
        decode_rows: list[int] = []
        decode_slots: list[torch.Tensor] = []
        keep: list[int] = []
        offset = 0
        for seq in seqs:
            q = len(seq.token_ids)
            ids.extend(seq.token_ids)
            positions.append(torch.arange(seq.start, seq.start + q))
            slot_mapping.append(seq.slots[seq.start :])
            if q == 1 and seq.start > 0:
                decode_rows.append(offset)
                decode_slots.append(seq.slots)
            else:
                prefills.append(self._prefill_seq(offset, q, seq.slots))
            offset += q
            if seq.sample:
                keep.extend(range(offset - seq.logits, offset))
        decode = self._decode_group(decode_rows, decode_slots) if decode_rows else None
        batch = PagedBatch(
            storage=self.storage,
            slot_mapping=torch.cat(slot_mapping),
            prefills=tuple(prefills),
            decode=decode,
            kernel=self.kernel,
        )
        input_ids = torch.tensor([ids], device=self.device)
        position_ids = torch.cat(positions).unsqueeze(0).to(self.device)
        kept = torch.tensor(keep, dtype=torch.long, device=self.device)
        extra = {"logits_to_keep": kept} if self.logits_to_keep else {}
        with paged_call(batch):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=no_mask(self.device),
                use_cache=False,
                **extra,
            )
        logits = out.logits[0]
        return logits if self.logits_to_keep else logits[kept]

    def _decode_group(self, rows: list[int], slots: list[torch.Tensor]) -> DecodeGroup:
        # Lengths from the host's own numbers: reading them back from the device would be a host sync per
        # step (the GPU drained before the step's first layer is queued).
        lengths = torch.tensor([s.shape[0] for s in slots], device=self.device)
        padded = pad_sequence(slots, batch_first=True)  # [B, width], slot 0 on pads
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        return DecodeGroup.padded(
            padded,
            lengths,
            block_size=None if self.kernel is None else self.storage.block_size,
            # Uploaded only when read (a blocking host-to-device copy on CUDA): contiguous rows are a slice.
            rows=None if contiguous else torch.tensor(rows, device=self.device),
            row_start=rows[0] if contiguous else None,
        )

    def _prefill_seq(self, start: int, q_len: int, slots: torch.Tensor) -> PrefillSeq:
        if self.kernel is None:
            return PrefillSeq(start=start, q_len=q_len, slots=slots)
        return PrefillSeq(
            start=start,
            q_len=q_len,
            slots=slots,
            block_table=block_table(slots, self.storage.block_size).unsqueeze(0),
            kv_len=torch.tensor([slots.shape[0]], dtype=torch.int32, device=self.device),
        )
