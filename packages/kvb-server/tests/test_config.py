from __future__ import annotations

import pytest

from kvb_server.config import ServerConfig


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"model_names": ()}, "model_names"),
        ({"model_names": ("m",), "max_queue_size": 0}, "max_queue_size"),
        ({"model_names": ("m",), "request_timeout_s": 0}, "request_timeout_s"),
        ({"model_names": ("m",), "api_key": " "}, "api_key"),
    ],
)
def test_server_config_rejects_bad_values(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServerConfig(**kw)
