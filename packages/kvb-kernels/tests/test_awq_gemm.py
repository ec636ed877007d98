"""``awq_gemm`` against a plain-torch AWQ GEMM dequantisation written here, independent of the package.

The reference unpacks each word with the AWQ nibble order spelled out below, dequantises in fp32 (exact for
fp16/bf16 scales), rounds once to the activation dtype (as the kernel's weight tile and AutoAWQ's dequant do),
then multiplies in fp32. The kernel accumulates in fp32 too, in another order, so the two fp32 results differ
by a few fp32 ulps of the sum of |x| |W| per output, and the output rounding to fp16/bf16 may land one unit in
the last place apart. That is the tolerance: 1 ulp of the output dtype plus 2^-16 of sum(|x| |W|).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvb_kernels import (
    DeviceError,
    DTypeError,
    GradientError,
    KernelUnavailableError,
    ShapeError,
    awq_gemm,
)
from kvb_kernels.awq import awq_dequantize, awq_unpack

# Nibble j (bits 4j..4j+3) of a word holds column ORDER[j] of its 8 (AutoAWQ's GEMM packing order).
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack(values: torch.Tensor) -> torch.Tensor:
    """int ``[rows, cols]`` in 0..15 -> int32 ``[rows, cols / 8]``, nibble j = column ORDER[j]."""
    rows, cols = values.shape
    grouped = values.reshape(rows, cols // 8, 8).to(torch.int64)
    words = sum(grouped[..., ORDER[j]] << (4 * j) for j in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # wrap as AutoAWQ's int32


def unpack(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack`, nibble by nibble."""
    rows, n_words = words.shape
    out = torch.empty(rows, n_words, 8, dtype=torch.int32)
    for j in range(8):
        out[..., ORDER[j]] = (words >> (4 * j)) & 0xF
    return out.reshape(rows, n_words * 8)


def reference(x, qweight, qzeros, scales, group_size):
    """fp32 ``x @ W`` with ``W`` rounded once to ``x``'s dtype, and sum(|x| |W|) (for the tolerance)."""
    q = unpack(qweight.cpu())
    z = unpack(qzeros.cpu()).repeat_interleave(group_size, dim=0)
    s = scales.cpu().float().repeat_interleave(group_size, dim=0)
    w = ((q - z).float() * s).to(x.dtype).float()
    xf = x.cpu().float()
    return xf @ w, xf.abs() @ w.abs()


def random_layer(in_features, out_features, group_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    qweight = pack(torch.randint(0, 16, (in_features, out_features), generator=gen))
    qzeros = pack(torch.randint(0, 16, (groups, out_features), generator=gen))
    scales = (torch.rand(groups, out_features, generator=gen) * 0.02 + 0.001).to(dtype)
    return qweight.to(device), qzeros.to(device), scales.to(device)


def assert_matches(y, x, qweight, qzeros, scales, group_size):
    ref, magnitude = reference(x, qweight, qzeros, scales, group_size)
    assert y.dtype == x.dtype and y.shape == ref.shape
    rounded = ref.to(x.dtype).float()
    ulp = (
        torch.finfo(x.dtype).eps * rounded.abs()
    )  # 1 ulp of the output dtype (eps * |v|, at least half an ulp)
    err = (y.cpu().float() - rounded).abs()
    bound = ulp + magnitude * 2**-16
    assert (err <= bound).all(), f"max error {err.max():.3g}, ratio {(err / bound).max():.3g}"


def test_hand_built_word():
    """Columns 1..8 packed in AWQ order: nibble j holds column ORDER[j], i.e. value ORDER[j] + 1."""
    word = pack(torch.arange(1, 9).reshape(1, 8))
    assert word.item() == 0x86427531 - 2**32  # as int32
    assert unpack(word).tolist() == [list(range(1, 9))]
    assert awq_unpack(word).tolist() == [list(range(1, 9))]
    # The kernel's per-column shift (nibble (c % 2) * 4 + c // 2) is the inverse of ORDER.
    assert [ORDER.index(c) for c in range(8)] == [(c % 2) * 4 + c // 2 for c in range(8)]


def test_reference_dequantize_matches_the_test_reference():
    qweight, qzeros, scales = random_layer(64, 24, 32, torch.float16, "cpu")
    q = unpack(qweight)
    z = unpack(qzeros).repeat_interleave(32, dim=0)
    want = ((q - z).float() * scales.float().repeat_interleave(32, dim=0)).half()
    assert torch.equal(awq_dequantize(qweight, qzeros, scales, 32, torch.float16), want)


SHAPES = [  # (tokens, in, out, group): M below, at and off the 16-row tile; N below and off the 32-column tile
    (1, 64, 8, 32),
    (3, 128, 24, 64),
    (17, 256, 72, 128),
    (64, 128, 256, 32),
    (5, 48, 40, 16),  # group 16 < BLOCK_K 32: each k-row fetches its own group; in not a multiple of BLOCK_K
]


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
@pytest.mark.parametrize(("tokens", "in_features", "out_features", "group_size"), SHAPES)
def test_matches_the_reference(tokens, in_features, out_features, group_size, dtype, device):
    qweight, qzeros, scales = random_layer(in_features, out_features, group_size, dtype, device, seed=tokens)
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    y = awq_gemm(x, qweight, qzeros, scales, group_size)
    assert_matches(y, x, qweight, qzeros, scales, group_size)


def test_strided_inputs_fp16_scales_for_bf16_and_empty_tokens(device):
    """A column slice of a larger layer (non-contiguous qweight/qzeros/scales), a transposed x, fp16 scales with
    bf16 activations (an AWQ checkpoint loaded into a bf16 model), and zero tokens."""
    qweight, qzeros, scales = random_layer(64, 48, 32, torch.float16, device)
    qweight, qzeros, scales = qweight[:, 1:5], qzeros[:, 1:5], scales[:, 8:40]
    x = torch.randn(64, 6).to(device, torch.bfloat16).t()
    assert not (x.is_contiguous() or qweight.is_contiguous())
    y = awq_gemm(x, qweight, qzeros, scales, 32)
    assert_matches(y, x, qweight, qzeros, scales, 32)
    empty = awq_gemm(x[:0], qweight, qzeros, scales, 32)
    assert empty.shape == (0, 32) and empty.dtype == torch.bfloat16


def test_kernel_module_is_found():
    """Served from the wheel's copy or the checkout's kernels/triton/ (importing kvb_kernels.triton needs Triton)."""
    pytest.importorskip("triton")
    spec = importlib.util.find_spec("kvb_kernels.triton.awq_gemm")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).parent.parts[-2:] in (("kvb_kernels", "triton"), ("kernels", "triton"))


def _inputs(dtype=torch.float16):
    qweight, qzeros, scales = random_layer(64, 16, 32, dtype, "cpu")
    return torch.randn(2, 64, dtype=dtype), qweight, qzeros, scales


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: {**a, "x": a["x"].double()}, DTypeError, "float16 or bfloat16"),
        (lambda a: {**a, "x": a["x"].to(torch.int32)}, DTypeError, "x has dtype"),
        (lambda a: {**a, "qweight": a["qweight"].to(torch.int64)}, DTypeError, "qweight.*int32"),
        (lambda a: {**a, "qzeros": a["qzeros"].to(torch.uint8)}, DTypeError, "qzeros.*int32"),
        (lambda a: {**a, "scales": a["scales"].double()}, DTypeError, "scales has dtype"),
        (lambda a: {**a, "x": a["x"][None]}, ShapeError, r"\[tokens, in\]"),
        (lambda a: {**a, "qweight": a["qweight"].flatten()}, ShapeError, "qweight must be 2-D"),
        (lambda a: {**a, "x": a["x"][:, :48]}, ShapeError, "qweight has 64 rows"),
        (lambda a: {**a, "group_size": 0}, ShapeError, "positive int"),
        (lambda a: {**a, "group_size": 32.0}, ShapeError, "positive int"),
        (lambda a: {**a, "group_size": True}, ShapeError, "positive int"),
        (lambda a: {**a, "group_size": 24}, ShapeError, "must divide in_features=64"),
        (lambda a: {**a, "group_size": 128}, ShapeError, "must divide in_features=64"),
        (lambda a: {**a, "group_size": 16}, ShapeError, "scales must be"),
        (lambda a: {**a, "qweight": a["qweight"][:, :1]}, ShapeError, r"qweight must be \[in, 2\]"),
        (lambda a: {**a, "scales": a["scales"][:, :12]}, ShapeError, "multiple of 8"),
        (lambda a: {**a, "qweight": a["qweight"].t()}, ShapeError, "qweight has 2 rows"),
        (lambda a: {**a, "qzeros": a["qzeros"][:, :1]}, ShapeError, "qzeros must be"),
        (lambda a: {**a, "scales": torch.cat([a["scales"]] * 2)}, ShapeError, "scales must be"),
        (lambda a: {**a, "scales": a["scales"].to("meta")}, DeviceError, "scales is on meta"),
        (lambda a: {**a, "x": a["x"].requires_grad_()}, GradientError, "forward-only"),
        (lambda a: {**a, "scales": a["scales"].requires_grad_()}, GradientError, "no_grad"),
    ],
)
def test_errors_name_the_fix(change, error, match):
    """Checked before anything needs Triton or a device, so these run everywhere."""
    x, qweight, qzeros, scales = _inputs()
    args = change({"x": x, "qweight": qweight, "qzeros": qzeros, "scales": scales, "group_size": 32})
    with pytest.raises(error, match=match):
        awq_gemm(**args)


def test_requires_grad_is_fine_under_no_grad(device):
    qweight, qzeros, scales = random_layer(64, 16, 32, torch.float16, device)
    x = torch.randn(2, 64, dtype=torch.float16, device=device, requires_grad=True)
    with torch.no_grad():
        y = awq_gemm(x, qweight, qzeros, scales, 32)
    assert_matches(y, x.detach(), qweight, qzeros, scales, 32)


def test_missing_triton_names_the_extra(monkeypatch):
    monkeypatch.setattr("kvb_kernels.backend.triton_installed", lambda: False)
    with pytest.raises(KernelUnavailableError, match=r"kvb-kernels\[triton\]"):
        awq_gemm(*_inputs(), 32)


def test_cpu_without_the_interpreter_is_a_device_error(monkeypatch):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(DeviceError, match="TRITON_INTERPRET=1"):
        awq_gemm(*_inputs(), 32)
