from __future__ import annotations

import pytest
import torch

from kvb_streaming.errors import StreamingError
from kvb_streaming.staging import CudaTransfer, SyncTransfer, make_transfer


def test_sync_transfer_copies_into_a_constant_buffer() -> None:
    transfer = SyncTransfer(torch.device("cpu"))
    slot = transfer.make_slot(0, 16)
    address = slot.buffer.data_ptr()
    transfer.copy(slot, torch.arange(10, dtype=torch.uint8))
    transfer.wait_ready(slot)
    assert slot.buffer[:10].tolist() == list(range(10))
    assert slot.buffer.data_ptr() == address and not transfer.in_flight(slot)
    assert transfer.synchronous


def test_make_transfer_picks_by_device() -> None:
    assert isinstance(make_transfer(torch.device("cpu")), SyncTransfer)
    with pytest.raises(StreamingError, match="SyncTransfer"):
        CudaTransfer(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_transfer_orders_copy_after_release_and_before_use() -> None:
    device = torch.device("cuda")
    transfer = CudaTransfer(device)
    slot = transfer.make_slot(0, 1 << 20)
    host = torch.full((1 << 20,), 7, dtype=torch.uint8).pin_memory()
    transfer.copy(slot, host)
    transfer.wait_ready(slot)
    total = slot.buffer.sum()  # on the compute stream, after the wait
    transfer.release(slot)
    host2 = torch.full((1 << 20,), 1, dtype=torch.uint8).pin_memory()
    transfer.copy(slot, host2)  # must not overwrite before `total` was computed
    transfer.wait_ready(slot)
    torch.cuda.synchronize()
    assert int(total) == 7 * (1 << 20)
    assert int(slot.buffer.sum()) == 1 << 20
    assert not transfer.in_flight(slot)
