from __future__ import annotations

import shutil

import pytest
import torch
from conftest import reference_attention, tolerance

from kvb_kernels import DeviceError, DTypeError, ShapeError, flash_attention
from kvb_kernels.backend import triton_installed

# Without Triton every entry point raises KernelUnavailableError before looking at the device or dtype.
needs_triton = pytest.mark.skipif(not triton_installed(), reason="Triton is not installed")

# (batch, heads, kv_heads, q_len, kv_len, head_dim): prefill, chunk over a cached prefix, decode, odd sizes.
CASES = [
    (2, 4, 2, 19, 19, 64),  # prefill, GQA group 2
    (1, 4, 1, 5, 37, 96),  # new tokens over a cached prefix, MQA, head dim 96 (not a power of two)
    (2, 6, 2, 1, 45, 64),  # decode, group 3
    (1, 2, 2, 33, 50, 32),  # multi-block queries and keys, no GQA
]


def _inputs(case, dtype, device, seed=0):
    batch, heads, kv_heads, q_len, kv_len, head_dim = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen).to(device, dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_causal_matches_sdpa(case, dtype, device):
    q, k, v = _inputs(case, dtype, device)
    out = flash_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), reference_attention(q, k, v), atol=tolerance(dtype), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sliding_window_and_non_causal(dtype, device):
    q, k, v = _inputs((1, 4, 2, 30, 41, 64), dtype, device)
    for window in (1, 7, 16):
        out = flash_attention(q, k, v, window=window)
        ref = reference_attention(q, k, v, window=window)
        torch.testing.assert_close(out.float(), ref, atol=tolerance(dtype), rtol=0)
    out = flash_attention(q, k, v, causal=False)
    torch.testing.assert_close(
        out.float(), reference_attention(q, k, v, causal=False), atol=tolerance(dtype), rtol=0
    )


def test_window_changes_the_result(device):
    q, k, v = _inputs((1, 2, 2, 20, 20, 32), torch.float32, device)
    assert (flash_attention(q, k, v, window=4) - flash_attention(q, k, v)).abs().max() > 1e-2


def test_padding_mask_and_fully_masked_rows(device):
    q, k, v = _inputs((2, 4, 2, 12, 12, 64), torch.float32, device)
    pad = torch.ones(2, 12, dtype=torch.bool, device=device)
    pad[1, :5] = False  # left padding of the second sequence
    mask = pad[:, None, None, :]  # [B, 1, 1, kv] broadcast over heads and queries
    out = flash_attention(q, k, v, attn_mask=mask)
    ref = reference_attention(q, k, v, mask=mask)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    # Queries 0..4 of sequence 1 see no key (causal + padding): zeros, not NaN.
    assert torch.equal(out[1, :, :5], torch.zeros_like(out[1, :, :5]))


def test_split_kv_equals_single_pass(device):
    q, k, v = _inputs((1, 4, 2, 3, 70, 64), torch.float32, device)
    single = flash_attention(q, k, v, num_splits=1)
    for splits in (2, 3, 8):  # 8 splits of 16 keys leave some splits empty for early queries
        torch.testing.assert_close(flash_attention(q, k, v, num_splits=splits), single, atol=2e-6, rtol=0)


def test_scale_and_strided_inputs(device):
    q, k, v = _inputs((1, 4, 2, 9, 9, 64), torch.float32, device)
    # transformers hands over [B, L, H, D] buffers transposed to [B, H, L, D]: non-contiguous.
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    out = flash_attention(q_t, k, v, scale=0.3)
    torch.testing.assert_close(out, reference_attention(q, k, v, scale=0.3), atol=2e-5, rtol=0)
    # The result is a view of a contiguous [B, L, H, D] buffer, the layout HF wants next.
    assert out.transpose(1, 2).is_contiguous()


def test_rejects_bad_inputs(device):
    q, k, v = _inputs((1, 4, 2, 4, 4, 32), torch.float32, device)
    with pytest.raises(ShapeError, match="multiple of key/value heads"):
        flash_attention(q[:, :3], k, v)
    with pytest.raises(DTypeError, match="boolean"):
        flash_attention(q, k, v, attn_mask=torch.zeros(1, 1, 4, 4, device=device))
    with pytest.raises(ShapeError, match="window"):
        flash_attention(q, k, v, window=0)
    with pytest.raises(ShapeError, match="broadcast"):
        flash_attention(q, k, v, attn_mask=torch.ones(1, 1, 4, 5, dtype=torch.bool, device=device))
    with pytest.raises(DTypeError, match="key"):
        flash_attention(q, k.half(), v)


@needs_triton
def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 2, 4, 32)
    with pytest.raises(DeviceError, match="CUDA"):
        flash_attention(q, q, q)


def test_missing_triton_is_an_import_error_naming_the_extra(monkeypatch):
    from kvb_kernels import KernelUnavailableError, backend

    monkeypatch.setattr(backend, "triton_installed", lambda: False)
    q = torch.randn(1, 2, 4, 32)
    with pytest.raises(KernelUnavailableError, match=r"kvb-kernels\[triton\]"):
        flash_attention(q, q, q)


@needs_triton
def test_bf16_is_not_served_by_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.randn(1, 2, 4, 32, dtype=torch.bfloat16)
    with pytest.raises(DTypeError, match="bfloat16"):
        flash_attention(q, q, q)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": 2.5}, "window must be an int"),
        ({"window": True}, "window must be an int"),
        ({"window": "3"}, "window must be an int"),
        ({"num_splits": 2.5}, "num_splits must be an int"),
        ({"scale": float("nan")}, "scale must be finite"),
        ({"scale": float("inf")}, "scale must be finite"),
    ],
)
def test_non_integer_sizes_and_non_finite_scale_are_shape_errors(kwargs, match, device):
    """These used to reach Triton (an InterpreterError / TypeError) or silently return NaN."""
    q = torch.randn(1, 2, 4, 32, device=device)
    with pytest.raises(ShapeError, match=match):
        flash_attention(q, q, q, **kwargs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_sees_one_opaque_op(device, backend):
    """Under torch.compile the launch is the ``kvb_kernels::flash_attention`` custom op (fullgraph, no graph
    break), and the compiled function gives the eager result. Inductor re-lowering the Triton kernel itself
    failed to compile it on an H200; the op keeps the kernel out of Inductor's hands."""
    if backend == "inductor" and device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("Inductor on the CPU needs a C++ compiler (g++)")
    q, k, v = _inputs((1, 4, 2, 6, 9, 32), torch.float32, device)
    mask = torch.ones(1, 1, 6, 9, dtype=torch.bool, device=device)
    mask[..., :2] = False  # left padding

    def attend(q, k, v, mask):
        return flash_attention(q, k, v, causal=True, attn_mask=mask) * 2

    eager = attend(q, k, v, mask)
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend=backend)(q, k, v, mask)
    assert compiled.shape == eager.shape
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=0)
    torch.testing.assert_close(compiled, reference_attention(q, k, v, mask=mask) * 2, atol=2e-5, rtol=0)


def test_inputs_that_require_grad_are_refused_not_silently_cut_off(device):
    # The output had no grad_fn: training through the kernel gave the projections no gradient.
    from kvb_kernels import GradientError

    q, k, v = _inputs(CASES[0], torch.float32, device)
    weight = q.clone().requires_grad_()
    with pytest.raises(GradientError, match="forward-only"):
        flash_attention(weight, k, v)
    with torch.no_grad():
        assert flash_attention(weight, k, v).shape == q.shape  # inference on parameters is fine
    # Keys and values too: the output had no grad_fn either, and they got no gradient.
    for name, args in (
        ("key", (q, k.clone().requires_grad_(), v)),
        ("value", (q, k, v.clone().requires_grad_())),
    ):
        with pytest.raises(GradientError, match=f"^{name} requires grad"):
            flash_attention(*args)


def test_numpy_and_tensor_ints_are_taken_as_ints(device):
    """window / num_splits as NumPy ints or 0-d tensors passed the checks, then failed inside Triton's launch
    with an untyped InterpreterError."""
    import numpy as np

    q, k, v = _inputs(CASES[0], torch.float32, device)
    want = flash_attention(q, k, v, causal=True, window=2, num_splits=2)
    for window, splits in ((np.int64(2), np.int64(2)), (torch.tensor(2), 2)):
        torch.testing.assert_close(
            flash_attention(q, k, v, causal=True, window=window, num_splits=splits), want
        )
