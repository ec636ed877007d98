from __future__ import annotations

import math

import torch

from kvb_kernels.splits import SplitBuffers, choose_num_splits, combine_splits


def test_combine_weights_splits_by_their_log2_sum_exp():
    # Two splits of one row: sums of exp are 2**3 and 2**1, so weights 0.8 and 0.2.
    out = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # [BH=1, S=2, R=1, D=2]
    lse = torch.tensor([[[3.0], [1.0]]])
    merged = combine_splits(SplitBuffers(out=out, lse=lse))
    torch.testing.assert_close(merged, torch.tensor([[[0.8, 0.2]]]))


def test_empty_splits_get_no_weight_and_empty_rows_are_zero():
    out = torch.tensor([[[[5.0]], [[7.0]]]])
    lse = torch.tensor([[[-math.inf], [0.5]]])
    assert combine_splits(SplitBuffers(out=out, lse=lse)).item() == 7.0
    lse = torch.full((1, 2, 1), -math.inf)
    assert combine_splits(SplitBuffers(out=out, lse=lse)).item() == 0.0


def test_no_splits_off_gpu():
    assert choose_num_splits(programs=1, kv_len=100_000, device=torch.device("cpu")) == 1
