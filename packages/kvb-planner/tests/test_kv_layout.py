import pytest

from kvb_planner import KVQuantLayout, PlannerConfigError, kv_cache_bytes


def test_unquantized_bytes(tiny_shape):
    # 2 (K,V) * 2 layers * 1 seq * 2 kv heads * 16 dims * 100 tokens * 4 bytes
    assert kv_cache_bytes(tiny_shape, tokens=100, batch_size=1, kv_bits=16) == 51_200
    assert kv_cache_bytes(tiny_shape, tokens=100, batch_size=3, kv_bits=16) == 3 * 51_200


def test_int8_bytes_with_scales_and_residual_window(tiny_shape):
    # T=1000, R=128 fp32 residual tokens, Q=872 quantized tokens, width = 2 heads * 16 = 32 channels, G=64.
    packed = 2 * 872 * 32 * 8 // 8  # 55,808
    key_scales = 14 * 32 * 2 * 4  # ceil(872/64)=14 token groups per channel, scale+zero fp32
    value_scales = 872 * 1 * 2 * 4  # one 32-channel group per token (ceil(32/64)=1)
    residual = 2 * 128 * 32 * 4
    assert (
        kv_cache_bytes(tiny_shape, tokens=1000, batch_size=1, kv_bits=8)
        == 2 * (packed + key_scales + value_scales + residual)
        == 198_272
    )


def test_int4_packs_two_values_per_byte(tiny_shape):
    layout = KVQuantLayout(group_size=32, residual_tokens=0)
    # Q=64: packed 2*64*32/2 = 2048; keys ceil(64/32)=2 groups * 32 ch * 8 B = 512; values 64*1*8 = 512.
    assert kv_cache_bytes(tiny_shape, tokens=64, batch_size=1, kv_bits=4, layout=layout) == 2 * (
        2048 + 512 + 512
    )


def test_short_cache_is_all_residual(tiny_shape):
    assert kv_cache_bytes(tiny_shape, tokens=100, batch_size=1, kv_bits=4) == kv_cache_bytes(
        tiny_shape, tokens=100, batch_size=1, kv_bits=16
    )


def test_quantized_is_smaller_for_long_caches(smollm2_shape):
    full = kv_cache_bytes(smollm2_shape, tokens=8192, batch_size=1, kv_bits=16)
    int8 = kv_cache_bytes(smollm2_shape, tokens=8192, batch_size=1, kv_bits=8)
    int4 = kv_cache_bytes(smollm2_shape, tokens=8192, batch_size=1, kv_bits=4)
    assert int4 < int8 < full / 3  # fp32 model: 8-bit codes are 4x smaller before scales


def test_rejects_bad_values(tiny_shape):
    with pytest.raises(PlannerConfigError, match="kv_bits"):
        kv_cache_bytes(tiny_shape, tokens=1, batch_size=1, kv_bits=3)
    with pytest.raises(PlannerConfigError, match="tokens"):
        kv_cache_bytes(tiny_shape, tokens=-1, batch_size=1, kv_bits=16)
    with pytest.raises(PlannerConfigError, match="group_size"):
        KVQuantLayout(group_size=0)


@pytest.mark.parametrize(
    ("field", "value"), [("batch_size", -1), ("batch_size", 0), ("tokens", float("nan")), ("tokens", 1.5)]
)
def test_counts_must_be_ints(tiny_shape, field, value):
    # A negative batch gave -5120 bytes, nan tokens a NaN estimate.
    kwargs = {"tokens": 10, "batch_size": 1, "kv_bits": 16, field: value}
    with pytest.raises(PlannerConfigError, match=field):
        kv_cache_bytes(tiny_shape, **kwargs)


def test_profile_and_ladder_values_must_be_numbers():
    from kvb_planner import DeviceProfile, LadderStep

    for bad in (float("nan"), float("inf"), 1.5, "300"):
        with pytest.raises(PlannerConfigError, match="free_bytes"):
            DeviceProfile(device="cpu", total_bytes=1 << 30, free_bytes=bad)
    with pytest.raises(PlannerConfigError, match="memory_bandwidth_gbps"):
        DeviceProfile(device="cpu", total_bytes=1, free_bytes=1, memory_bandwidth_gbps="fast")
    for bad in (1.5, float("nan"), True):
        with pytest.raises(PlannerConfigError, match="prefill_chunk_size"):
            LadderStep(prefill_chunk_size=bad)
