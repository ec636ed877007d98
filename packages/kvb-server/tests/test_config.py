from __future__ import annotations

import pytest

from kvb_server.config import ServerConfig, TenantKey


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"model_names": ()}, "model_names"),
        ({"model_names": ("m",), "max_queue_size": 0}, "max_queue_size"),
        ({"model_names": ("m",), "request_timeout_s": 0}, "request_timeout_s"),
        ({"model_names": ("m",), "api_key": " "}, "api_key"),
        ({"model_names": ("m",), "max_body_bytes": 0}, "max_body_bytes"),
        ({"model_names": ("m",), "max_json_depth": 10_000}, "max_json_depth"),
        ({"model_names": ("m",), "shutdown_timeout_s": 0}, "shutdown_timeout_s"),
        (
            {"model_names": ("m",), "api_key": "k", "tenant_keys": (TenantKey(key="k", salt="s"),)},
            "distinct",
        ),
    ],
)
def test_server_config_rejects_bad_values(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServerConfig(**kw)
