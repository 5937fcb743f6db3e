"""Memory snapshots and diffs: cgroup files read exactly, real process pages seen, ranked diffs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from diag_paths import FIXTURES

from ctxwarden.diagnostics.cgroup import lookup_cgroup
from ctxwarden.diagnostics.memdiff import diff_snapshots, unit_of
from ctxwarden.diagnostics.process_memory import read_process_memory
from ctxwarden.diagnostics.snapshot import (RISK_CRITICAL, RISK_HIGH, RISK_OK, kv_memory_from_stats,
                                            owner_risk, take_snapshot)
from ctxwarden.errors import NoSuchProcess
from ctxwarden.kv import KVCacheManager
from ctxwarden.plan.kv import KVGroup, KVLayout

MiB = 2**20


def test_cgroup_v2_files_are_read_exactly():
    found = lookup_cgroup(cgroup_root=FIXTURES / "v2-before")
    cg = found.memory
    assert found.reason is None and cg.version == 2
    assert (cg.memory_max_bytes, cg.memory_current_bytes, cg.memory_peak_bytes) == (4 * 2**30, 3 * 2**30, 3_500_000_000)
    assert cg.headroom_bytes == 2**30
    assert cg.memory_high_bytes is None and cg.swap_max_bytes is None  # "max" = no limit
    assert (cg.stat["anon"], cg.stat["file_mapped"], cg.stat["pgmajfault"]) == (2**30, 2**30, 321)
    assert cg.events == {"low": 0, "high": 0, "max": 17, "oom": 1, "oom_kill": 0, "oom_group_kill": 0}
    assert cg.pressure["some"] == {"avg10": 1.23, "avg60": 0.45, "avg300": 0.10, "total_us": 1234567.0}
    assert cg.pressure_scope == "cgroup"


def test_the_process_cgroup_path_is_followed_and_walked_up():
    proc = FIXTURES / "proc-nested"
    exact = lookup_cgroup(4242, FIXTURES / "v2-nested", proc).memory
    assert exact.path.endswith("app.slice/ctxwarden.scope")
    assert exact.memory_max_bytes is None and exact.memory_peak_bytes is None  # no limit; old kernel
    deeper = lookup_cgroup(4343, FIXTURES / "v2-nested", proc).memory  # .../worker has no files
    assert deeper.path == exact.path


def test_missing_controllers_are_said_not_raised(tmp_path):
    no_mem = lookup_cgroup(cgroup_root=FIXTURES / "v2-no-memory")
    assert no_mem.memory is None and "no memory controller" in no_mem.reason
    nothing = lookup_cgroup(cgroup_root=tmp_path)
    assert nothing.memory is None
    assert nothing.reason == f"no cgroup v2 at {tmp_path} (no cgroup.controllers) and no cgroup v1 memory controller"


def test_cgroup_v1_stands_in_when_there_is_no_v2():
    found = lookup_cgroup(cgroup_root=FIXTURES / "v1")
    cg = found.memory
    assert cg.version == 1 and "no cgroup v2" in found.reason
    assert (cg.memory_max_bytes, cg.memory_current_bytes, cg.memory_peak_bytes) == (8 * 2**30, 2 * 2**30, 3 * 2**30)
    assert cg.events == {"oom_kill": 3} and cg.stat["rss"] == 1006632960


def test_this_machine_is_described_without_crashing():
    found = lookup_cgroup()
    has_v2 = Path("/sys/fs/cgroup/cgroup.controllers").is_file()
    assert (found.memory is not None and found.memory.version == 2) or not has_v2
    if not has_v2:
        assert "no cgroup v2 at /sys/fs/cgroup" in found.reason


def test_process_memory_sees_a_real_allocation(child):
    before = read_process_memory(child.pid)
    child.send(f"keep {64 * MiB}")
    after = read_process_memory(child.pid)
    grown = after.rss_anon_bytes - before.rss_anon_bytes
    assert 60 * MiB <= grown <= 70 * MiB
    assert after.leak_basis_bytes == after.rss_anon_bytes + after.swap_bytes
    assert after.uss_bytes >= 60 * MiB and after.pss_bytes >= after.uss_bytes
    assert after.rss_bytes >= after.rss_anon_bytes + after.rss_file_bytes - MiB
    assert after.peak_rss_bytes >= after.rss_bytes - MiB


def test_a_dead_pid_is_a_named_error():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(NoSuchProcess, match=f"no process with pid {dead.pid}"):
        read_process_memory(dead.pid)


def test_diff_ranks_growth_within_units(child):
    a = take_snapshot(child.pid, FIXTURES / "v2-before").to_dict()
    child.send(f"keep {32 * MiB}")
    b = take_snapshot(child.pid, FIXTURES / "v2-after").to_dict()
    d = diff_snapshots(a, b)
    units = [c.unit for c in d.changes]
    assert units == sorted(units, key=["bytes", "blocks", "count", "percent", "us", "ratio", "number"].index)
    top = d.changes[0]
    assert top.key in ("cgroup.stat.anon", "cgroup.stat.inactive_anon") and top.delta == 768 * MiB
    by_key = {c.key: c for c in d.changes}
    assert 30 * MiB <= by_key["process.rss_anon_bytes"].delta <= 36 * MiB
    assert by_key["cgroup.events.oom_kill"].delta == 1 and by_key["cgroup.events.oom_kill"].unit == "count"
    assert by_key["cgroup.stat.pgmajfault"].delta == 4000
    assert by_key["cgroup.pressure.some.avg10"].unit == "percent"
    byte_changes = [c for c in d.changes if c.unit == "bytes"]
    first_shrink = next(i for i, c in enumerate(byte_changes) if c.delta < 0)
    assert all(c.delta > 0 for c in byte_changes[:first_shrink])
    assert by_key["cgroup.stat.file"].delta == -128 * MiB


def test_units_follow_the_kernel_names():
    assert unit_of("cgroup.stat.anon") == "bytes"
    assert unit_of("cgroup.stat.workingset_refault_file") == "count"
    assert unit_of("cgroup.stat.total_pgmajfault") == "count"
    assert unit_of("cgroup.events.oom_kill") == "count"
    assert unit_of("kv.num_blocks_in_use") == "blocks"
    assert unit_of("process.swap_bytes") == "bytes"


def test_kv_section_from_a_real_manager():
    layout = KVLayout((KVGroup("full", (0, 1), None),), 4, 64)
    m = KVCacheManager(layout, 10)
    m.allocate("a", list(range(10)))  # 3 blocks, the last holds 2 of 4 tokens
    kv = kv_memory_from_stats(m.stats(), layout.page_bytes, host_swap_bytes=4096).to_dict()
    assert (kv["num_blocks_in_use"], kv["num_blocks_free"]) == (3, 7)
    assert kv["in_use_bytes"] == 3 * layout.page_bytes and kv["total_bytes"] == 10 * layout.page_bytes
    assert kv["internal_waste"] == pytest.approx(2 / 12)
    assert kv["host_swap_bytes"] == 4096


def test_owner_risk_by_age():
    assert owner_risk("running", 100.0, 1.0) == RISK_OK
    assert owner_risk("finished", 1.9, 1.0) == RISK_OK
    assert owner_risk("finished", 2.1, 1.0) == RISK_HIGH
    assert owner_risk("none", 0.0, 1.0) == RISK_CRITICAL
    with pytest.raises(ValueError, match="owner state must be one of"):
        owner_risk("zombie", 0.0, 1.0)


def test_cli_snapshot_and_diff(child, tmp_path, cli):
    def run(*a):
        rc, out, err = cli("diag", "mem", *a)
        assert rc == 0, err
        return out

    a_path, b_path = tmp_path / "a.json", tmp_path / "b.json"
    snap = json.loads(run("snapshot", "--pid", str(child.pid), "--cgroup-root", str(FIXTURES / "v2-before"),
                          "--json", "--out", str(a_path)))
    assert set(snap) == {"schema_version", "time", "process", "cgroup", "kv", "owners", "notes"}
    assert snap["process"]["pid"] == child.pid and snap["cgroup"]["memory_max_bytes"] == 4 * 2**30
    assert snap["kv"] is None and snap["owners"] == []
    child.send(f"keep {16 * MiB}")
    run("snapshot", "--pid", str(child.pid), "--cgroup-root", str(FIXTURES / "v2-after"), "--out", str(b_path))
    diff = json.loads(run("diff", str(a_path), str(b_path), "--json"))
    assert diff["changes"][0]["delta"] == 768 * MiB and diff["elapsed_s"] > 0
    text = run("diff", str(a_path), str(b_path))
    assert "changes in bytes" in text and "cgroup.events.oom_kill" in text
