"""FA2-style attention over dense K/V ``[batch, kv_heads, kv_len, head_dim]`` (any strides).

One program owns ``BLOCK_M`` *packed* query rows of one (batch, kv head): row ``r`` is query position
``r // GROUP`` of query head ``kv_head * GROUP + r % GROUP``. Packing the GQA group into the rows means each K/V
tile is loaded once for the whole group (no ``repeat_kv``) and a decode step (``q_len == 1``) still fills a tile.
The key range is walked in up to three loops: masked blocks on the window's left edge, blocks no mask can touch
(loads and score masking skipped), masked blocks on the causal diagonal / tail. With a dense boolean mask every
block is masked. ``num_splits > 1`` splits the key range across programs (flash-decoding); the partial results
are merged by :func:`kvb_kernels.splits.combine_splits`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvb_kernels.triton.common import keep_scores, online_softmax_step, store_result


@triton.jit
def _dense_blocks(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    mask_base,
    q_abs,
    row_ok,
    offs_d,
    d_ok,
    start,
    end,
    kv_len,
    window,
    qk_scale,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    stride_mn,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd  # [BLOCK_D, BLOCK_N]
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd  # [BLOCK_N, BLOCK_D]
        if MASKED:
            n_ok = offs_n < kv_len
            k = tl.load(k_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        qk = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale
        if MASKED:
            keep = keep_scores(q_abs, offs_n, kv_len, window, CAUSAL, HAS_WINDOW)
            if HAS_MASK:
                m_ptrs = mask_base + offs_n[None, :] * stride_mn
                user = tl.load(m_ptrs, mask=row_ok[:, None] & (offs_n[None, :] < kv_len), other=0)
                keep = keep & (user != 0)
            qk = tl.where(keep, qk, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, qk, v, INPUT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def dense_attention_kernel(
    Q,
    K,
    V,
    Mask,
    Out,
    OPart,
    LsePart,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    qk_scale,
    num_kv_heads,
    q_len,
    kv_len,
    window,
    num_splits,
    ROWS_KEY,
    KV_KEY,  # autotune keys only (bucketed sizes)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    k_base = K + b.to(tl.int64) * stride_kb + kvh * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kvh * stride_vh
    mask_base = (
        Mask
        + b.to(tl.int64) * stride_mb
        + head[:, None] * stride_mh
        + q_idx[:, None].to(tl.int64) * stride_mm
    )

    # Key range this row block can see, then the sub-range no mask can touch.
    first_abs = (pid_m * BLOCK_M) // GROUP + (kv_len - q_len)
    last_abs = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP + (kv_len - q_len)
    lo = 0
    hi = kv_len
    full_lo = 0
    full_hi = (kv_len // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(hi, last_abs + 1)
        full_hi = (tl.minimum(first_abs + 1, kv_len) // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        lo = (tl.maximum(first_abs - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_abs - window + 1, 0), BLOCK_N) * BLOCK_N
    if HAS_MASK:
        full_lo = hi
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)

    # This program's share of the key range (split-KV); split edges are multiples of BLOCK_N.
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    s_lo = pid_s * split_len
    s_hi = s_lo + split_len

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, m_i, l_i = _dense_blocks(
        acc,
        m_i,
        l_i,
        q,
        k_base,
        v_base,
        mask_base,
        q_abs,
        row_ok,
        offs_d,
        d_ok,
        tl.maximum(lo, s_lo),
        tl.minimum(full_lo, s_hi),
        kv_len,
        window,
        qk_scale,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        stride_mn,
        BLOCK_N,
        BLOCK_D == HEAD_DIM,
        True,
        CAUSAL,
        HAS_WINDOW,
        HAS_MASK,
        INPUT_PRECISION,
    )
    acc, m_i, l_i = _dense_blocks(
        acc,
        m_i,
        l_i,
        q,
        k_base,
        v_base,
        mask_base,
        q_abs,
        row_ok,
        offs_d,
        d_ok,
        tl.maximum(full_lo, s_lo),
        tl.minimum(full_hi, s_hi),
        kv_len,
        window,
        qk_scale,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        stride_mn,
        BLOCK_N,
        BLOCK_D == HEAD_DIM,
        False,
        CAUSAL,
        HAS_WINDOW,
        HAS_MASK,
        INPUT_PRECISION,
    )
    acc, m_i, l_i = _dense_blocks(
        acc,
        m_i,
        l_i,
        q,
        k_base,
        v_base,
        mask_base,
        q_abs,
        row_ok,
        offs_d,
        d_ok,
        tl.maximum(full_hi, s_lo),
        tl.minimum(hi, s_hi),
        kv_len,
        window,
        qk_scale,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        stride_mn,
        BLOCK_N,
        BLOCK_D == HEAD_DIM,
        True,
        CAUSAL,
        HAS_WINDOW,
        HAS_MASK,
        INPUT_PRECISION,
    )
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
