"""Attention that reads K/V through a block table (pages of a shared pool) instead of a contiguous tensor.

Same row packing, online softmax and split-KV as :mod:`kvb_kernels.triton.dense`. Each key tile gathers its
rows token by token: logical token ``t`` of sequence ``b`` lives in page ``block_table[b, t // PAGE_SIZE]`` at
slot ``t % PAGE_SIZE``, so any page size works (not only powers of two) and a stitched prefix is never
concatenated. Every block is masked (per-sequence lengths differ), which is cheap next to the gather.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvb_kernels.triton.common import keep_scores, online_softmax_step, store_result


@triton.jit
def paged_attention_kernel(
    Q,
    KPages,
    VPages,
    BlockTable,
    KVLens,
    Out,
    OPart,
    LsePart,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kp,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vp,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_tb,
    stride_tp,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    qk_scale,
    num_kv_heads,
    q_len,
    max_kv_len,
    window,
    num_splits,
    ROWS_KEY,
    KV_KEY,  # autotune keys only (bucketed sizes)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SPLIT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads
    n_rows = q_len * GROUP
    kv_len = tl.load(KVLens + b)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    q_idx = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    q_abs = q_idx + (kv_len - q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = (
        Q
        + b.to(tl.int64) * stride_qb
        + head[:, None] * stride_qh
        + q_idx[:, None] * stride_qm
        + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    table = BlockTable + b.to(tl.int64) * stride_tb

    first_abs = (pid_m * BLOCK_M) // GROUP + (kv_len - q_len)
    last_abs = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP + (kv_len - q_len)
    lo = 0
    hi = kv_len
    if CAUSAL:
        hi = tl.minimum(hi, last_abs + 1)
    if HAS_WINDOW:
        lo = (tl.maximum(first_abs - window + 1, 0) // BLOCK_N) * BLOCK_N
    split_len = tl.cdiv(tl.cdiv(max_kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = tl.maximum(lo, pid_s * split_len)
    end = tl.minimum(hi, pid_s * split_len + split_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_len
        page = tl.load(table + (offs_n // PAGE_SIZE) * stride_tp, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % PAGE_SIZE
        k_ptrs = (
            KPages
            + page[None, :] * stride_kp
            + kvh * stride_kh
            + slot[None, :] * stride_kn
            + offs_d[:, None] * stride_kd
        )
        v_ptrs = (
            VPages
            + page[:, None] * stride_vp
            + kvh * stride_vh
            + slot[:, None] * stride_vn
            + offs_d[None, :] * stride_vd
        )
        k = tl.load(k_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale
        keep = keep_scores(q_abs, offs_n, kv_len, window, CAUSAL, HAS_WINDOW)
        qk = tl.where(keep, qk, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, qk, v, INPUT_PRECISION)

    store_result(
        acc,
        m_i,
        l_i,
        Out,
        OPart,
        LsePart,
        b,
        head,
        q_idx,
        rows,
        row_ok,
        offs_d,
        d_ok,
        pid_bh,
        pid_s,
        num_splits,
        n_rows,
        stride_ob,
        stride_oh,
        stride_om,
        stride_od,
        HEAD_DIM,
        SPLIT,
    )
