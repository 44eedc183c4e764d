"""The thread count honours cgroup CPU quotas (v2 ``cpu.max``, v1 ``cfs_quota_us``) and the
CPU affinity (refengine.cpu.threads)."""

from __future__ import annotations

import math

import pytest


def write_cgroup(root, files: dict[str, str]):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("proc, files, quota", [
    ("0::/\n", {"cpu.max": "200000 100000\n"}, 2.0),  # cgroup v2, namespace root
    ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),  # no limit
    ("0::/job/step\n", {"job/cpu.max": "300000 100000\n", "job/step/cpu.max": "max 100000\n"}, 3.0),  # a parent's
    ("0::/job\n", {"cpu.max": "100000 100000\n", "job/cpu.max": "400000 100000\n"}, 1.0),  # the tightest
    ("4:cpu,cpuacct:/docker/abc\n1:memory:/docker/abc\n",
     {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"},
     0.5),  # cgroup v1
    ("4:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
     None),
    ("0::/\n", {}, None),  # no controller files
])
def test_cgroup_cpu_quota(tmp_path, proc, files, quota):
    from refengine.cpu.threads import cgroup_cpu_quota

    write_cgroup(tmp_path / "cg", files)
    (tmp_path / "self_cgroup").write_text(proc)
    got = cgroup_cpu_quota(str(tmp_path / "cg"), str(tmp_path / "self_cgroup"))
    assert got == (None if quota is None else pytest.approx(quota))


@pytest.mark.parametrize("affinity, quota, cores", [(64, 2.0, 2), (64, 1.5, 2), (64, 0.5, 1), (4, 8.0, 4),
                                                    (64, None, 64)])
def test_usable_cores_is_the_affinity_capped_by_the_quota(monkeypatch, affinity, quota, cores):
    from refengine.cpu import threads

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda *a, **k: quota)
    assert threads.usable_cores() == cores == min(affinity, math.ceil(quota) if quota else affinity)


def test_a_two_cpu_container_starts_two_threads(monkeypatch, tmp_path):
    """A container limited to 2 CPUs on a 64-core host: configure_threads sizes the pools to 2."""
    from refengine.cpu import threads

    write_cgroup(tmp_path / "cg", {"cpu.max": "200000 100000\n"})
    (tmp_path / "self_cgroup").write_text("0::/\n")
    monkeypatch.setattr(threads, "CGROUP_ROOT", str(tmp_path / "cg"))
    monkeypatch.setattr(threads, "PROC_SELF_CGROUP", str(tmp_path / "self_cgroup"))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(threads, "_set_pools", lambda *a: None)
    for name in ("_requested", "_adaptive", "_current", "_last_sample", "_library_blas"):
        monkeypatch.setattr(threads, name, getattr(threads, name))  # restored after the test
    assert threads.configure_threads(None) == 2 and threads.max_threads() == 2
