from __future__ import annotations

import pytest
import torch

from kvb_kernels import DTypeError, KiviKV, ShapeError, flash_attention, kivi_attention, kivi_quantize


def _kv(device, length=45, seed=0):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(2, 2, length, 64, generator=gen)
    key[..., 3] *= 20  # an outlier channel, the case per-channel key scales exist for
    value = torch.randn(2, 2, length, 64, generator=gen)
    return key.to(device), value.to(device)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_codec_error_is_within_half_a_step(device, scale_dtype):
    """Half a stored step whatever the scales' dtype: rounded to nearest, bf16 steps fell short of the range
    (1.7 steps of error at the top of a group), fp16 0.62."""
    key, value = _kv(device)
    key, value = key + 3.0, value - 5.0  # zero points far from 0, where a rounded one lands off the range
    coded = kivi_quantize(key, value, group_size=16, scale_dtype=scale_dtype)
    assert coded.key_scale.dtype == coded.value_zero.dtype == scale_dtype
    k_hat, v_hat = coded.dequantize(torch.float32)
    k_step = coded.key_scale.float().repeat_interleave(16, dim=2)[:, :, :45]
    assert ((k_hat - key).abs() <= k_step / 2 * (1 + 1e-5) + 1e-6).all()
    assert ((v_hat - value).abs() <= coded.value_scale.float() / 2 * (1 + 1e-5) + 1e-6).all()
    # Per-channel key scales keep the outlier channel from flattening the others.
    assert coded.key_scale[..., 3].min() > 5 * coded.key_scale[..., 0].max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("q_len", "window", "splits"), [(1, None, 3), (5, None, 1), (4, 9, 2)])
def test_fused_equals_dequantize_then_attend(q_len, window, splits, dtype, device):
    key, value = _kv(device)
    coded = kivi_quantize(key, value, group_size=16)
    q = torch.randn(2, 4, q_len, 64, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    fused = kivi_attention(q, coded, window=window, num_splits=splits)
    k_hat, v_hat = coded.dequantize(dtype)
    unfused = flash_attention(q, k_hat, v_hat, window=window)
    atol = 2e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(fused.float(), unfused.float(), atol=atol, rtol=0)


def test_layout_errors(device):
    key, value = _kv(device, length=8)
    coded = kivi_quantize(key, value, group_size=4)
    with pytest.raises(ShapeError, match="key_scale must have shape"):
        KiviKV(
            key_codes=coded.key_codes,
            key_scale=coded.key_scale[:, :, :1],
            key_zero=coded.key_zero,
            value_codes=coded.value_codes,
            value_scale=coded.value_scale,
            value_zero=coded.value_zero,
            group_size=4,
        )
    with pytest.raises(DTypeError, match="uint8"):
        KiviKV(
            key_codes=coded.key_codes.to(torch.int16),
            key_scale=coded.key_scale,
            key_zero=coded.key_zero,
            value_codes=coded.value_codes,
            value_scale=coded.value_scale,
            value_zero=coded.value_zero,
            group_size=4,
        )
    with pytest.raises(ShapeError, match="group_size"):
        kivi_quantize(key, value, group_size=0)


def test_non_integer_group_size_is_a_shape_error():
    key, value = _kv("cpu", length=8)
    with pytest.raises(ShapeError, match="group_size must be an int"):
        kivi_quantize(key, value, group_size=2.5)
    coded = kivi_quantize(key, value, group_size=4)
    with pytest.raises(ShapeError, match="group_size must be an int"):
        KiviKV(
            key_codes=coded.key_codes,
            key_scale=coded.key_scale,
            key_zero=coded.key_zero,
            value_codes=coded.value_codes,
            value_scale=coded.value_scale,
            value_zero=coded.value_zero,
            group_size=4.0,
        )


@pytest.mark.parametrize("name", ["key_scale", "key_zero", "value_scale", "value_zero"])
def test_scales_on_another_device_are_a_device_error(name, device):
    """Only the codes were checked: scales/zeros left on another device reached the kernel (Triton's untyped
    'cannot be accessed from Triton' on CUDA)."""
    import dataclasses

    from kvb_kernels import DeviceError

    coded = kivi_quantize(*_kv(device, length=16), group_size=8)
    moved = dataclasses.replace(coded, **{name: getattr(coded, name).to("meta")})
    with pytest.raises(DeviceError, match=name):
        kivi_attention(torch.randn(2, 2, 1, 64, device=device), moved)


def test_torch_compile_sees_one_opaque_op(device):
    """Under torch.compile kivi_attention is the ``kvb_kernels::kivi_attention`` custom op (fullgraph) and
    gives the eager result."""
    key, value = _kv(device)
    coded = kivi_quantize(key, value, group_size=16)
    q = torch.randn(2, 4, 3, 64, generator=torch.Generator().manual_seed(2)).to(device)
    eager = kivi_attention(q, coded)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q: kivi_attention(q, coded) * 1, fullgraph=True, backend="aot_eager")(q)
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=0)


def test_scales_are_checked(device):
    """Integer scales were taken as they were (wrong K/V, silently), an integer scale_dtype was an untyped
    RuntimeError, fp16 scales of K/V past its range decoded to NaN; a NumPy group_size failed in the launch."""
    import numpy as np

    key, value = _kv(device)
    coded = kivi_quantize(key, value, group_size=np.int64(8))
    assert type(coded.group_size) is int
    fields = {
        f: getattr(coded, f)
        for f in ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")
    }
    with pytest.raises(DTypeError, match="key_scale must be floating point"):
        KiviKV(**{**fields, "key_scale": coded.key_scale.int()}, group_size=8)
    with pytest.raises(DTypeError, match="scale_dtype must be a floating dtype"):
        kivi_quantize(key, value, scale_dtype=torch.int32)
    with pytest.raises(DTypeError, match="overflow"):
        kivi_quantize(key * 1e6, value, scale_dtype=torch.float16)
