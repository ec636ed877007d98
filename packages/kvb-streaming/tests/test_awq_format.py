from __future__ import annotations

import pytest
import torch

from kvb_streaming.awq_format import (
    AWQ_ORDER,
    AWQ_REVERSE_ORDER,
    AWQTensors,
    check_shapes,
    dequantize,
    pack_int4,
    quantize,
    unpack_int4,
)
from kvb_streaming.errors import AWQFormatError


def test_reverse_order_inverts_order() -> None:
    assert [AWQ_ORDER[AWQ_REVERSE_ORDER[j]] for j in range(8)] == list(range(8))


def test_pack_places_columns_in_awq_nibble_order() -> None:
    # Column j holds value j + 1; nibble i must hold column AWQ_ORDER[i], i.e. value AWQ_ORDER[i] + 1.
    values = torch.arange(1, 9, dtype=torch.int32).reshape(1, 8)
    word = int(pack_int4(values)[0, 0]) & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [1, 3, 5, 7, 2, 4, 6, 8]
    assert word == 0x86427531
    # The naive order (nibble i = column i) would give 0x87654321: make sure we are not producing that.
    assert word != 0x87654321


def test_pack_wraps_high_words_to_negative_int32() -> None:
    packed = pack_int4(torch.full((1, 8), 15, dtype=torch.int32))
    assert packed.dtype == torch.int32
    assert int(packed[0, 0]) == -1


def test_unpack_reads_a_hand_built_awq_word() -> None:
    # Nibble i holds value AWQ_ORDER[i]: columns in natural order must come out as 0..7.
    word = sum(AWQ_ORDER[i] << (4 * i) for i in range(8))
    words = torch.tensor([[word]], dtype=torch.int64).to(torch.int32)
    assert unpack_int4(words).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]


def test_pack_unpack_round_trip_exact() -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (37, 64), generator=generator, dtype=torch.int32)
    assert torch.equal(unpack_int4(pack_int4(values)), values)


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(AWQFormatError, match="multiple of 8"):
        pack_int4(torch.zeros(2, 12, dtype=torch.int32))
    with pytest.raises(AWQFormatError, match=r"0\.\.15"):
        pack_int4(torch.full((1, 8), 16, dtype=torch.int32))
    with pytest.raises(AWQFormatError, match="int32"):
        unpack_int4(torch.zeros(1, 1, dtype=torch.int64))


def _reference_dequant(tensors: AWQTensors, group_size: int) -> torch.Tensor:
    """Element-by-element spec: w[i, j] = (q[i, j] - z[i // g, j]) * s[i // g, j], in float64."""
    q = unpack_int4(tensors.qweight).double()
    z = unpack_int4(tensors.qzeros).double()
    s = tensors.scales.double()
    w = torch.empty_like(q)
    for i in range(q.shape[0]):
        w[i] = (q[i] - z[i // group_size]) * s[i // group_size]
    return w


def test_quantize_shapes_and_dtypes() -> None:
    awq = quantize(torch.randn(48, 64), group_size=16)  # nn.Linear weight [out=48, in=64]
    assert awq.qweight.shape == (64, 6) and awq.qweight.dtype == torch.int32
    assert awq.qzeros.shape == (4, 6) and awq.qzeros.dtype == torch.int32
    assert awq.scales.shape == (4, 48) and awq.scales.dtype == torch.float16


def test_quantization_error_is_at_most_half_a_step() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(32, 128, generator=generator)
    awq = quantize(weight, group_size=32)
    w = _reference_dequant(awq, 32)  # [in, out]
    step = awq.scales.double().repeat_interleave(32, dim=0)
    error = (w - weight.t().double()).abs()
    # Round-to-nearest: half a step, plus the fp16 rounding of the scale over <= 15 steps.
    assert bool((error <= step * 0.5 + step * 15 * 2**-11 + 1e-6).all())
    assert float(error.max()) > 0  # it really is quantized


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_within_one_rounding_of_the_reference(dtype: torch.dtype) -> None:
    awq = quantize(torch.randn(40, 96, generator=torch.Generator().manual_seed(2)), group_size=32)
    reference = _reference_dequant(awq, 32)
    got = dequantize(awq, 32, dtype)
    assert got.dtype == dtype and got.shape == (96, 40)
    if dtype == torch.float32:
        assert torch.equal(got.double(), reference)  # small int times fp16 is exact in fp32
    else:
        ulp = torch.finfo(dtype).eps  # relative spacing at 1.0
        assert bool(((got.double() - reference).abs() <= reference.abs() * ulp / 2 + 1e-12).all())


def test_dequantize_detects_wrong_group_size() -> None:
    awq = quantize(torch.randn(8, 64), group_size=32)
    with pytest.raises(AWQFormatError, match="group_size"):
        dequantize(awq, 16)


def test_check_shapes_suggests_group_sizes_that_fit() -> None:
    # SmolLM2-135M's hidden size: 128 does not divide it, so it must not be suggested.
    with pytest.raises(AWQFormatError, match=r"such as 64 or 32$"):
        check_shapes(576, 64, 128)
    with pytest.raises(AWQFormatError, match=r"that divides it$"):
        check_shapes(24, 16, 32)


def test_check_shapes() -> None:
    check_shapes(64, 16, 32)
    with pytest.raises(AWQFormatError, match="must divide"):
        check_shapes(48, 16, 32)
    with pytest.raises(AWQFormatError, match="multiple of 8"):
        check_shapes(64, 12, 32)
