"""Host RAM a process may still use: the smaller of the kernel's "available" and its cgroup headroom.

``psutil.virtual_memory().available`` describes the whole machine; inside a container the cgroup limit is
what triggers the OOM killer, so the headroom is ``limit - (usage - inactive_file)`` at the process's own
cgroup *and every ancestor* (a parent's limit binds its children). ``inactive_file`` is page cache the
kernel reclaims before it kills anything, the same working-set rule kubelet uses. Both cgroup v2
(``memory.max``/``memory.current``) and v1 (``memory.limit_in_bytes``/``memory.usage_in_bytes``) are read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import psutil

logger = logging.getLogger(__name__)

#: cgroup v1 reports "no limit" as PAGE_COUNTER_MAX rounded to pages (~2**63); anything this big is unlimited.
UNLIMITED_THRESHOLD = 1 << 60
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


class CgroupMemory(NamedTuple):
    """The tightest memory limit among a cgroup and its ancestors, and the headroom left under it."""

    limit_bytes: int
    headroom_bytes: int


class HostMemory(NamedTuple):
    """RAM as the planner sees it."""

    total_bytes: int
    available_bytes: int
    #: Present when a cgroup memory limit applies to this process.
    cgroup: CgroupMemory | None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _inactive_file(stat_path: Path, key: str) -> int:
    try:
        for line in stat_path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_dirs(cgroup_root: Path, proc_cgroup: Path) -> tuple[list[Path], bool]:
    """Directories from the process's memory cgroup up to the hierarchy root, and whether it is v2."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return [], False
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        base = cgroup_root if v2 else cgroup_root / "memory"
        leaf = base / rel.lstrip("/")
        # In a cgroup namespace the listed path may not exist under the mount; the mount root is then ours.
        if not leaf.is_dir():
            leaf = base
        dirs = [leaf, *[p for p in leaf.parents if p == base or base in p.parents]]
        return dirs, v2
    return [], False


def read_cgroup_memory(
    *, cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP
) -> CgroupMemory | None:
    """Tightest limit and headroom over the process's cgroup and its ancestors; ``None`` when unlimited.

    Args:
        cgroup_root: Where the cgroup filesystem is mounted (a fake tree in tests).
        proc_cgroup: The ``/proc/<pid>/cgroup`` file naming the process's cgroup.
    """
    dirs, v2 = _cgroup_dirs(cgroup_root, proc_cgroup)
    limit_file, usage_file, inactive_key = (
        ("memory.max", "memory.current", "inactive_file")
        if v2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    )
    limits: list[int] = []
    headrooms: list[int] = []
    for folder in dirs:
        limit = _read_int(folder / limit_file)
        if limit is None or limit >= UNLIMITED_THRESHOLD:
            continue
        usage = _read_int(folder / usage_file) or 0
        working_set = max(0, usage - _inactive_file(folder / "memory.stat", inactive_key))
        limits.append(limit)
        headrooms.append(max(0, limit - working_set))
    if not limits:
        return None
    return CgroupMemory(limit_bytes=min(limits), headroom_bytes=min(headrooms))


def read_host_memory(*, cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> HostMemory:
    """RAM total and available to this process: ``min(psutil, cgroup)`` for both."""
    vm = psutil.virtual_memory()
    cgroup = read_cgroup_memory(cgroup_root=cgroup_root, proc_cgroup=proc_cgroup)
    if cgroup is None:
        return HostMemory(total_bytes=vm.total, available_bytes=vm.available, cgroup=None)
    logger.debug("cgroup memory limit %d bytes, headroom %d bytes", cgroup.limit_bytes, cgroup.headroom_bytes)
    return HostMemory(
        total_bytes=min(vm.total, cgroup.limit_bytes),
        available_bytes=min(vm.available, cgroup.headroom_bytes),
        cgroup=cgroup,
    )
