"""kvb-server: an OpenAI-compatible HTTP server for the KVBoost engine."""

from kvb_server._version import __version__
from kvb_server.app import create_app
from kvb_server.config import ServerConfig, TenantKey
from kvb_server.engine import ServingEngine
from kvb_server.errors import (
    AuthenticationError,
    CacheBusyConflictError,
    EngineError,
    InvalidParameterError,
    ModelNotFoundError,
    PermissionDeniedError,
    QueueFullError,
    RequestTimeoutError,
    RequestTooLargeError,
    ServerError,
    ShuttingDownError,
    UnsupportedFeatureError,
)
from kvb_server.gate import (
    AdmissionDecision,
    AdmissionRequest,
    AdmitAll,
    EngineSettings,
    ReportingGate,
    RequestGate,
    RunProbe,
)
from kvb_server.planner_gate import PlannerGate, planner_available, require_planner

__all__ = [
    "AdmissionDecision",
    "AdmissionRequest",
    "AdmitAll",
    "AuthenticationError",
    "CacheBusyConflictError",
    "EngineError",
    "EngineSettings",
    "InvalidParameterError",
    "ModelNotFoundError",
    "PermissionDeniedError",
    "PlannerGate",
    "QueueFullError",
    "ReportingGate",
    "RequestGate",
    "RequestTimeoutError",
    "RequestTooLargeError",
    "RunProbe",
    "ServerConfig",
    "ServerError",
    "ServingEngine",
    "ShuttingDownError",
    "TenantKey",
    "UnsupportedFeatureError",
    "__version__",
    "create_app",
    "planner_available",
    "require_planner",
]
