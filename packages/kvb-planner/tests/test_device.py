import json

import pytest
import torch

from kvb_planner import DeviceProfile, PlannerConfigError, ProbeSettings, UnsupportedDeviceError

GIB = 1 << 30
FAST = ProbeSettings(buffer_bytes=1 << 20, budget_s=0.2, decode_context_tokens=8)


def test_cpu_probe_uses_cgroup_headroom(tmp_path):
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "memory.max").write_text(f"{GIB}\n")
    (root / "memory.current").write_text(f"{GIB // 4}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    profile = DeviceProfile.probe("cpu", settings=FAST, cgroup_root=root, proc_cgroup=proc)
    assert profile.device == "cpu"
    assert profile.total_bytes == GIB
    assert profile.free_bytes == 3 * GIB // 4
    assert profile.memory_bandwidth_gbps > 0 and profile.host_to_device_gbps is None
    assert profile.decode_step_ms is None and profile.fallbacks == ()
    assert profile.cpu_threads == torch.get_num_threads()  # the CPU attention kernel's tiles are per thread


def test_cpu_probe_with_model_measures_decode(tiny_llama):
    profile = DeviceProfile.probe("cpu", model=tiny_llama, settings=FAST)
    assert profile.decode_step_ms is not None and profile.decode_step_ms > 0
    payload = profile.to_dict()
    assert json.loads(json.dumps(payload, allow_nan=False)) == payload
    assert set(payload) == {
        "device",
        "total_mb",
        "free_mb",
        "memory_bandwidth_gbps",
        "host_to_device_gbps",
        "decode_step_ms",
        "cpu_threads",
        "fallbacks",
    }


def test_unsupported_devices():
    with pytest.raises(UnsupportedDeviceError, match="cpu"):
        DeviceProfile.probe("meta")
    if not torch.cuda.is_available():
        with pytest.raises(UnsupportedDeviceError, match="CUDA is not available"):
            DeviceProfile.probe("cuda")


def test_device_must_be_a_torch_device():
    """Any string was taken, and "gpu" / "CUDA:0" were then planned by the CPU's (cheaper) rules."""
    for bad in ("gpu", "CUDA:0", "", "cuda0"):
        with pytest.raises(PlannerConfigError, match="torch device"):
            DeviceProfile(device=bad, total_bytes=2, free_bytes=1)
    assert DeviceProfile(device=torch.device("cuda", 1), total_bytes=2, free_bytes=1).device == "cuda:1"


def test_validation():
    with pytest.raises(PlannerConfigError, match="cannot exceed"):
        DeviceProfile(device="cpu", total_bytes=1, free_bytes=2)
    with pytest.raises(PlannerConfigError, match="memory_bandwidth_gbps"):
        DeviceProfile(device="cpu", total_bytes=2, free_bytes=1, memory_bandwidth_gbps=float("nan"))
    with pytest.raises(PlannerConfigError, match="decode_step_ms"):
        DeviceProfile(device="cpu", total_bytes=2, free_bytes=1, decode_step_ms=float("inf"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_probe(tiny_llama):  # pragma: no cover - not run on the CPU-only CI machine
    profile = DeviceProfile.probe("cuda", model=tiny_llama.cuda(), settings=FAST)
    _, total = torch.cuda.mem_get_info()
    assert profile.total_bytes == total and 0 < profile.free_bytes <= total
    assert profile.host_to_device_gbps > 0 and profile.memory_bandwidth_gbps > 0
    assert profile.decode_step_ms > 0


@pytest.mark.parametrize("device", ["tpu", "cuda:x", None])
def test_unparseable_device_is_an_unsupported_device_error(device):
    # torch.device("tpu") raised a bare RuntimeError listing every device type torch knows.
    with pytest.raises(UnsupportedDeviceError, match="cpu"):
        DeviceProfile.probe(device)
