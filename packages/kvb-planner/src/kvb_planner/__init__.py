"""kvb-planner: decide before a request runs whether it fits in memory, and how.

``plan(request, profile, shape)`` walks a ladder of (prefill chunk size, KV bits) settings and returns the
first whose predicted peak fits the free memory, an auto-truncated plan, or a refusal with a JSON body an
HTTP layer can send as a 413.
"""

from kvb_planner._version import __version__
from kvb_planner.calibration import (
    CalibrationSettings,
    CalibrationStats,
    CalibrationTracker,
    Cohort,
    CohortStats,
    ResidualStats,
)
from kvb_planner.device import DeviceProfile
from kvb_planner.errors import PlannerConfigError, PlannerError, UnsupportedDeviceError
from kvb_planner.host_memory import CgroupMemory, HostMemory, read_cgroup_memory, read_host_memory
from kvb_planner.kv_layout import KVQuantLayout, kv_cache_bytes
from kvb_planner.ladder import Ladder, LadderStep
from kvb_planner.memory_model import MemoryEstimate, estimate_memory
from kvb_planner.paged_loop import PagedLoop
from kvb_planner.planner import PlannerPolicy, RequestPlan, Verdict, plan
from kvb_planner.probes import ProbeResult, ProbeSettings
from kvb_planner.refusal import PlanRefusal
from kvb_planner.request import PlanRequest
from kvb_planner.shape import ModelShape
from kvb_planner.tensor_peak import tensor_peak

__all__ = [
    "CalibrationSettings",
    "CalibrationStats",
    "CalibrationTracker",
    "CgroupMemory",
    "Cohort",
    "CohortStats",
    "DeviceProfile",
    "HostMemory",
    "KVQuantLayout",
    "Ladder",
    "LadderStep",
    "MemoryEstimate",
    "ModelShape",
    "PagedLoop",
    "PlanRefusal",
    "PlanRequest",
    "PlannerConfigError",
    "PlannerError",
    "PlannerPolicy",
    "ProbeResult",
    "ProbeSettings",
    "RequestPlan",
    "ResidualStats",
    "UnsupportedDeviceError",
    "Verdict",
    "__version__",
    "estimate_memory",
    "kv_cache_bytes",
    "plan",
    "read_cgroup_memory",
    "read_host_memory",
    "tensor_peak",
]
