from pathlib import Path

import psutil

from kvb_planner import read_cgroup_memory, read_host_memory

GIB = 1 << 30


def v2_tree(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    # parent: 4 GiB limit, 3 GiB used (0.5 GiB reclaimable page cache); leaf: 8 GiB limit, 1 GiB used.
    (root / "parent" / "leaf").mkdir(parents=True)
    (root / "parent" / "memory.max").write_text(f"{4 * GIB}\n")
    (root / "parent" / "memory.current").write_text(f"{3 * GIB}\n")
    (root / "parent" / "memory.stat").write_text(f"anon 123\ninactive_file {GIB // 2}\n")
    (root / "parent" / "leaf" / "memory.max").write_text(f"{8 * GIB}\n")
    (root / "parent" / "leaf" / "memory.current").write_text(f"{GIB}\n")
    (root / "memory.max").write_text("max\n")  # the hierarchy root itself is unlimited
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/parent/leaf\n")
    return root, proc


def test_v2_takes_the_tightest_ancestor(tmp_path):
    root, proc = v2_tree(tmp_path)
    cgroup = read_cgroup_memory(cgroup_root=root, proc_cgroup=proc)
    assert cgroup.limit_bytes == 4 * GIB
    assert cgroup.headroom_bytes == 4 * GIB - (3 * GIB - GIB // 2)  # 1.5 GiB: the parent binds


def test_v1_memory_controller(tmp_path):
    root = tmp_path / "cgroup"
    leaf = root / "memory" / "docker" / "abc"
    leaf.mkdir(parents=True)
    (leaf / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    (leaf / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (leaf / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {GIB // 4}\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1 "unlimited"
    proc = tmp_path / "proc_cgroup"
    proc.write_text("12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    cgroup = read_cgroup_memory(cgroup_root=root, proc_cgroup=proc)
    assert cgroup == (2 * GIB, 2 * GIB - (GIB - GIB // 4))


def test_unlimited_or_missing_cgroup_is_none(tmp_path):
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "memory.max").write_text("max\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    assert read_cgroup_memory(cgroup_root=root, proc_cgroup=proc) is None
    assert read_cgroup_memory(cgroup_root=root, proc_cgroup=tmp_path / "missing") is None


def test_namespaced_path_falls_back_to_the_mount_root(tmp_path):
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "memory.max").write_text(f"{GIB}\n")
    (root / "memory.current").write_text(f"{GIB // 4}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/not/visible/here\n")
    assert read_cgroup_memory(cgroup_root=root, proc_cgroup=proc) == (GIB, 3 * GIB // 4)


def test_host_memory_is_min_of_psutil_and_cgroup(tmp_path):
    root, proc = v2_tree(tmp_path)
    ram = read_host_memory(cgroup_root=root, proc_cgroup=proc)
    vm = psutil.virtual_memory()
    assert ram.total_bytes == min(vm.total, 4 * GIB)
    # The cgroup headroom (1.5 GiB) binds unless the machine itself has less available.
    expected = 3 * GIB // 2 if vm.available > 2 * GIB else None
    assert ram.available_bytes <= 3 * GIB // 2
    if expected is not None:
        assert ram.available_bytes == expected
