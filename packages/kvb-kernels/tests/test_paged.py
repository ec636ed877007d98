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


def test_strided_kv_lens_are_read_per_sequence(device):
    """kv_lens as a strided view (e.g. every other entry of a larger tensor) must give each sequence its own
    length; the kernel reads kv_lens with unit stride, so it used to read the neighbouring entry."""
    lens = [29, 11]
    kv = _paged(device, torch.float32, lens=lens, page_size=8)
    spaced = torch.tensor([29, 0, 11, 0], dtype=torch.int32, device=device)[::2]
    strided = PagedKV(
        key_pages=kv.key_pages, value_pages=kv.value_pages, block_table=kv.block_table, kv_lens=spaced
    )
    q = torch.randn(2, 4, 1, 64, generator=torch.Generator().manual_seed(1)).to(device)
    torch.testing.assert_close(paged_attention(q, strided), paged_attention(q, kv), atol=0, rtol=0)


def test_page_indices_and_lengths_are_checked(device):
    kv = _paged(device, torch.float32, lens=[16, 9], page_size=8, spare_pages=0)
    q = torch.randn(2, 2, 1, 64, device=device)
    num_pages = kv.key_pages.shape[0]
    for bad in (num_pages, -1):
        table = kv.block_table.clone()
        table[1, 1] = bad  # sequence 1 holds 9 tokens: its second page is in use
        broken = PagedKV(
            key_pages=kv.key_pages, value_pages=kv.value_pages, block_table=table, kv_lens=kv.kv_lens
        )
        with pytest.raises(ShapeError, match="outside the pool"):
            paged_attention(q, broken)
    lens = torch.tensor([16, 8], dtype=torch.int32, device=device)
    table = kv.block_table.clone()
    table[1, 1] = -1  # past sequence 1's last page: ignored, as documented
    padded = PagedKV(key_pages=kv.key_pages, value_pages=kv.value_pages, block_table=table, kv_lens=lens)
    exact = PagedKV(
        key_pages=kv.key_pages, value_pages=kv.value_pages, block_table=kv.block_table, kv_lens=lens
    )
    torch.testing.assert_close(paged_attention(q, padded), paged_attention(q, exact), atol=0, rtol=0)
    negative = torch.tensor([16, -2], dtype=torch.int32, device=device)
    with pytest.raises(ShapeError, match="negative"):
        paged_attention(
            q,
            PagedKV(
                key_pages=kv.key_pages,
                value_pages=kv.value_pages,
                block_table=kv.block_table,
                kv_lens=negative,
            ),
        )


def test_gather_ignores_table_entries_past_each_sequence():
    """gather() (the unfused reference) indexed every table entry: a sentinel past a sequence's last page raised
    IndexError, and padding was zeroed by multiplying, so an inf in a page slot past kv_lens became NaN."""
    keys = torch.randn(5, 2, 6, 8)
    keys[4, :, 0] = float("inf")  # page 4 is listed for sequence 0 but lies past its 12 tokens
    lens = torch.tensor([12, 15], dtype=torch.int32)
    listed = torch.tensor([[3, 1, 4], [0, 1, 2]], dtype=torch.int32)
    dense_k, _ = PagedKV(key_pages=keys, value_pages=keys, block_table=listed, kv_lens=lens).gather()
    assert dense_k.shape == (2, 2, 15, 8) and torch.isfinite(dense_k).all()
    assert torch.equal(dense_k[0, :, :6], keys[3]) and torch.equal(dense_k[0, :, 6:12], keys[1])
    assert bool((dense_k[0, :, 12:] == 0).all())
    sentinel = torch.tensor([[3, 1, 999], [0, 1, 2]], dtype=torch.int32)
    dense_s, _ = PagedKV(key_pages=keys, value_pages=keys, block_table=sentinel, kv_lens=lens).gather()
    assert torch.equal(dense_s, dense_k)


def test_torch_compile_sees_one_opaque_op(device):
    """Under torch.compile paged_attention is the ``kvb_kernels::paged_attention`` custom op (fullgraph: its
    host-side table checks and the Triton launch stay out of the graph) and gives the eager result."""
    kv = _paged(device, torch.float32, lens=[13, 7], page_size=4)
    q = torch.randn(2, 4, 2, 64, generator=torch.Generator().manual_seed(5)).to(device)

    def attend(q, key_pages, value_pages, table, lens):
        kv = PagedKV(key_pages=key_pages, value_pages=value_pages, block_table=table, kv_lens=lens)
        return paged_attention(q, kv, window=6) + 1

    args = (q, kv.key_pages, kv.value_pages, kv.block_table, kv.kv_lens)
    eager = attend(*args)
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=0)


def test_an_empty_batch_gathers_to_empty_tensors():
    """paged_attention takes an empty batch; gather() raised (reshape could not infer a length of 0)."""
    from kvb_kernels import PagedKV

    kv = PagedKV(
        key_pages=torch.randn(3, 1, 4, 16),
        value_pages=torch.randn(3, 1, 4, 16),
        block_table=torch.zeros(0, 2, dtype=torch.int32),
        kv_lens=torch.zeros(0, dtype=torch.int32),
    )
    keys, values = kv.gather()
    assert kv.max_kv_len == 0 and keys.shape == values.shape == (0, 1, 0, 16)


@pytest.mark.parametrize("window", [None, 5])
def test_a_host_side_max_len_skips_the_read_back_and_gives_the_same_result(window, device, monkeypatch):
    """An engine knows every length on the host: with ``max_len`` the call reads nothing back from the device
    (on CUDA a host sync per layer) and attends exactly as without it, for the exact bound and a larger one."""
    from kvb_kernels import paged

    kv = _paged(device, torch.float32, lens=[29, 11, 17], page_size=6)
    q = torch.randn(3, 4, 2, 64, generator=torch.Generator().manual_seed(3)).to(device)
    expected = paged_attention(q, kv, window=window, num_splits=2)

    def no_read_back(*_args):
        raise AssertionError("kv_lens was read back although max_len was given")

    monkeypatch.setattr(paged, "_table_summary", no_read_back)
    for bound in (29, 30, kv.block_table.shape[1] * kv.page_size):
        hinted = PagedKV(
            key_pages=kv.key_pages,
            value_pages=kv.value_pages,
            block_table=kv.block_table,
            kv_lens=kv.kv_lens,
            max_len=bound,
        )
        assert hinted.max_kv_len == bound
        torch.testing.assert_close(
            paged_attention(q, hinted, window=window, num_splits=2), expected, atol=0, rtol=0
        )


def test_max_len_outside_the_table_is_refused(device):
    kv = _paged(device, torch.float32, lens=[16, 9], page_size=8)
    capacity = kv.block_table.shape[1] * kv.page_size
    for bad in (-1, capacity + 1, 12.0, True, "16"):
        with pytest.raises(ShapeError, match="max_len"):
            PagedKV(
                key_pages=kv.key_pages,
                value_pages=kv.value_pages,
                block_table=kv.block_table,
                kv_lens=kv.kv_lens,
                max_len=bad,
            )


def test_torch_compile_keeps_max_len(device, monkeypatch):
    """The custom op carries ``max_len``: a compiled call reads nothing back either."""
    from kvb_kernels import paged

    kv = _paged(device, torch.float32, lens=[13, 7], page_size=4)
    q = torch.randn(2, 4, 1, 64, generator=torch.Generator().manual_seed(6)).to(device)
    eager = paged_attention(q, kv)
    monkeypatch.setattr(paged, "_table_summary", lambda *_: pytest.fail("kv_lens read back"))

    def attend(q, key_pages, value_pages, table, lens):
        hinted = PagedKV(
            key_pages=key_pages, value_pages=value_pages, block_table=table, kv_lens=lens, max_len=13
        )
        return paged_attention(q, hinted)

    torch._dynamo.reset()
    args = (q, kv.key_pages, kv.value_pages, kv.block_table, kv.kv_lens)
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=0)
