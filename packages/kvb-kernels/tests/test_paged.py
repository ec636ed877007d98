from __future__ import annotations

import pytest
import torch
from conftest import reference_attention, tolerance

from kvb_kernels import PagedKV, ShapeError, flash_attention, paged_attention


def _paged(device, dtype, *, lens, page_size, kv_heads=2, head_dim=64, spare_pages=3, seed=0):
    """A pool with pages in shuffled order, so a sequence's pages are never contiguous or in order."""
    gen = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page_size) for n in lens)
    num_pages = len(lens) * max_pages + spare_pages
    keys = torch.randn(num_pages, kv_heads, page_size, head_dim, generator=gen).to(device, dtype)
    values = torch.randn(num_pages, kv_heads, page_size, head_dim, generator=gen).to(device, dtype)
    order = torch.randperm(num_pages, generator=gen)[: len(lens) * max_pages]
    table = order.view(len(lens), max_pages).to(device, torch.int32)
    return PagedKV(
        key_pages=keys,
        value_pages=values,
        block_table=table,
        kv_lens=torch.tensor(lens, dtype=torch.int32, device=device),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("q_len", "page_size", "window"), [(1, 16, None), (4, 6, None), (3, 8, 5)])
def test_matches_attention_over_the_gathered_kv(q_len, page_size, window, dtype, device):
    lens = [29, 11]
    kv = _paged(device, dtype, lens=lens, page_size=page_size)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, q_len, 64, generator=gen).to(device, dtype)
    out = paged_attention(q, kv, window=window, num_splits=2)
    keys, values = kv.gather()
    for b, n in enumerate(lens):  # each sequence over its own length: bottom-right alignment per sequence
        ref = reference_attention(
            q[b : b + 1], keys[b : b + 1, :, :n], values[b : b + 1, :, :n], window=window
        )
        torch.testing.assert_close(out[b : b + 1].float(), ref, atol=tolerance(dtype), rtol=0)


def test_pages_shared_between_sequences(device):
    """Two sequences stitched from the same prefix pages (the cached-chunk case) read them in place."""
    kv = _paged(device, torch.float32, lens=[16, 16], page_size=8)
    shared = kv.block_table.clone()
    shared[1, 0] = shared[0, 0]  # both sequences start with the same cached chunk
    kv = PagedKV(key_pages=kv.key_pages, value_pages=kv.value_pages, block_table=shared, kv_lens=kv.kv_lens)
    q = torch.randn(2, 2, 1, 64, device=device)
    keys, values = kv.gather()
    assert torch.equal(keys[0, :, :8], keys[1, :, :8])
    torch.testing.assert_close(paged_attention(q, kv), flash_attention(q, keys, values), atol=2e-6, rtol=0)


def test_layout_errors(device):
    kv = _paged(device, torch.float32, lens=[8], page_size=8)
    with pytest.raises(ShapeError, match="int32"):
        PagedKV(
            key_pages=kv.key_pages,
            value_pages=kv.value_pages,
            block_table=kv.block_table.long(),
            kv_lens=kv.kv_lens,
        )
    too_long = torch.tensor([9], dtype=torch.int32, device=device)
    short = PagedKV(
        key_pages=kv.key_pages, value_pages=kv.value_pages, block_table=kv.block_table, kv_lens=too_long
    )
    with pytest.raises(ShapeError, match="add pages"):
        paged_attention(torch.randn(1, 2, 1, 64, device=device), short)
