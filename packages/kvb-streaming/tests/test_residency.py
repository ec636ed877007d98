from __future__ import annotations

import pytest

from kvb_streaming.config import StreamingConfig
from kvb_streaming.errors import StreamingConfigError
from kvb_streaming.residency import plan_residency

LINEARS = ["self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"]
MLP = ("mlp.up_proj", "mlp.down_proj")


def test_full_resident_streams_nothing() -> None:
    plan = plan_residency(StreamingConfig(residency_mode="full_resident"), [LINEARS] * 4)
    assert plan.streamed_layers == ()


def test_full_stream_streams_every_linear_of_every_layer() -> None:
    plan = plan_residency(StreamingConfig(residency_mode="full_stream"), [LINEARS] * 3)
    assert plan.streamed_layers == (0, 1, 2)
    assert all(plan.streamed[i] == tuple(LINEARS) for i in range(3))


def test_partial_resident_keeps_the_ends() -> None:
    config = StreamingConfig(residency_mode="partial_resident", keep_first_k=2, keep_last_k=1)
    plan = plan_residency(config, [LINEARS] * 6)
    assert plan.streamed_layers == (2, 3, 4)
    assert plan.is_streamed(3, "self_attn.q_proj") and not plan.is_streamed(0, "mlp.up_proj")


def test_ffn_only_stream_streams_only_mlp_outside_kept_layers() -> None:
    config = StreamingConfig(residency_mode="ffn_only_stream", keep_last_k=1)
    plan = plan_residency(config, [LINEARS] * 3)
    assert plan.streamed == {0: MLP, 1: MLP}


def test_keep_larger_than_model_is_an_error() -> None:
    config = StreamingConfig(residency_mode="partial_resident", keep_first_k=3, keep_last_k=2)
    with pytest.raises(StreamingConfigError, match="exceeds the model's 4 decoder layers"):
        plan_residency(config, [LINEARS] * 4)


def test_ffn_only_stream_without_mlp_linears_is_an_error() -> None:
    """A model whose feed-forward weights are not AWQ linears under "mlp." (Mixtral's fused experts) streamed
    nothing in this mode, silently loading everything on the device."""
    attention_only = ["self_attn.q_proj", "self_attn.o_proj"]
    with pytest.raises(StreamingConfigError, match="no quantized feed-forward linear"):
        plan_residency(StreamingConfig(residency_mode="ffn_only_stream"), [attention_only] * 3)
    # every layer kept: nothing to stream is what was asked for
    kept = StreamingConfig(residency_mode="ffn_only_stream", keep_first_k=2, keep_last_k=1)
    assert plan_residency(kept, [attention_only] * 3).streamed_layers == ()
