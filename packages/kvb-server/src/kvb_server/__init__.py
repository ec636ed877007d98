"""kvb-server: an OpenAI-compatible HTTP server for the KVBoost engine."""

from kvb_server._version import __version__
from kvb_server.app import create_app
from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine
from kvb_server.errors import (
    AuthenticationError,
    EngineError,
    InvalidParameterError,
    ModelNotFoundError,
    QueueFullError,
    RequestTimeoutError,
    RequestTooLargeError,
    ServerError,
    UnsupportedFeatureError,
)
from kvb_server.gate import AdmissionDecision, AdmissionRequest, AdmitAll, RequestGate
from kvb_server.sampling import SamplingParams

__all__ = [
    "AdmissionDecision",
    "AdmissionRequest",
    "AdmitAll",
    "AuthenticationError",
    "EngineError",
    "InvalidParameterError",
    "ModelNotFoundError",
    "QueueFullError",
    "RequestGate",
    "RequestTimeoutError",
    "RequestTooLargeError",
    "SamplingParams",
    "ServerConfig",
    "ServerError",
    "ServingEngine",
    "UnsupportedFeatureError",
    "__version__",
    "create_app",
]
