"""doctor: environment read from the real machine, findings from fixture limits, a real model
measured against its plan, SLO and leak findings, and the JSON shape."""

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
from diag_paths import FIXTURES

from ctxwarden.diagnostics.doctor import (SEVERITIES, Finding, ModelMeasurement, build_report,
                                          environment_findings, leak_findings, model_findings,
                                          slo_findings)
from ctxwarden.diagnostics.environment import collect_environment, cpu_quota, read_cpu
from ctxwarden.diagnostics.leaks import LeakSample, assess_leak
from ctxwarden.diagnostics.request_log import RequestRecord
from ctxwarden.diagnostics.slo import SLO, measure_risk

IDLE = (0.0, 0.0, 0.0)


@pytest.fixture(scope="module")
def env_here():
    return collect_environment()


def fixture_env(root, **changes):
    env = collect_environment(cgroup_root=FIXTURES / root, probe_torch=False)
    env = dataclasses.replace(env, torch={"version": "x", "num_threads": 2, "cpu_capability": "AVX512"},
                              threads={**env.threads, "cpus_allowed": 2, "cpu_quota": None})
    return dataclasses.replace(env, **changes)


def by_what(findings, text):
    return [f for f in findings if text in f.what]


def test_environment_is_read_from_this_machine(env_here):
    assert env_here.torch["version"] == importlib.metadata.version("torch")
    assert env_here.torch["num_threads"] >= 1
    assert env_here.threads["cpus_allowed"] == len(os.sched_getaffinity(0))
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    assert env_here.cpu["flags"]["avx2"] == ("avx2" in flags)
    assert env_here.cgroup is not None or env_here.cgroup_note


def test_cpu_quota_from_cgroup_files():
    assert cpu_quota(FIXTURES / "v2-before") == 2.0
    assert cpu_quota(FIXTURES / "v2-after") is None  # "max"
    assert cpu_quota(FIXTURES / "v1") == 1.5


def test_cpu_flags_parse(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\n")
    cpu = read_cpu(info)
    assert cpu["model"] == "Test CPU" and cpu["flags"]["avx2"] and not cpu["flags"]["avx512f"]


def test_limits_and_events_become_findings():
    near = environment_findings(fixture_env("v2-after"), IDLE)  # 3.63 of 4 GiB, one OOM kill
    assert by_what(near, "about to hit memory.max")[0].severity == "high"
    assert "oom_kill 1" in by_what(near, "OOM-killed")[0].evidence
    roomy = environment_findings(fixture_env("v2-before"), IDLE)  # 3 of 4 GiB: 25% free
    assert by_what(roomy, "headroom")[0].severity == "ok"
    assert not by_what(roomy, "OOM-killed")


def test_thread_and_policy_findings():
    env = fixture_env("v2-before", openmp_wait_policy=None)
    busy = environment_findings(env, (3.0, 3.0, 3.0))
    assert by_what(busy, "spin while the CPUs are shared")[0].severity == "warning"
    assert by_what(environment_findings(env, IDLE), "spin on idle CPUs")[0].severity == "ok"
    over = dataclasses.replace(env, torch={**env.torch, "num_threads": 8})
    assert "OMP_NUM_THREADS=2" in by_what(environment_findings(over, IDLE), "more torch threads")[0].fix
    no_avx512 = dataclasses.replace(env, cpu={"model": "old", "flags": {"avx2": True}})
    found = by_what(environment_findings(no_avx512, IDLE), "no AVX-512")[0]
    assert found.severity == "info" and "bf16" in found.what  # AVX2 fp32 is not slow (doctor.py)
    swapping = dataclasses.replace(env, memory={**env.memory, "swap_used_bytes": 2**30})
    assert by_what(environment_findings(swapping, IDLE), "swap is in use")


def test_a_real_model_is_measured_against_its_plan(tiny_model_dir, env_here):
    out = subprocess.run([sys.executable, "-m", "ctxwarden", "doctor", "--model", str(tiny_model_dir),
                          "--kv-memory", "32MiB", "--json"], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert set(got) == {"environment", "findings", "model"}
    m = ModelMeasurement(**got["model"])
    assert m.kv_allocated_bytes == m.kv_planned_bytes == m.num_blocks * m.page_bytes
    assert m.kv_planned_bytes <= 32 * 2**20 < m.kv_planned_bytes + m.page_bytes
    assert m.format == "safetensors" and m.weights_planned_bytes > 0
    assert m.rss_loaded_bytes > m.rss_baseline_bytes > m.rss_before_torch_bytes
    findings = [Finding(**f) for f in got["findings"]]
    assert [SEVERITIES.index(f.severity) for f in findings] == sorted(SEVERITIES.index(f.severity) for f in findings)
    assert by_what(findings, "KV pool: planned == allocated")
    weights = by_what(findings, "weights")[0]
    ratio = m.weights_loaded_bytes / m.weights_planned_bytes
    assert weights.severity == ("ok" if ratio <= 1.02 else "warning") and f"{ratio:.2f}x" in weights.evidence


def test_a_kv_mismatch_is_critical(env_here):
    m = ModelMeasurement("m", "safetensors", "float32", 100, 100, 4096, 2048, 4, 1024, 0.1, 0.01,
                         10, 200, 300, 250, 50, 150, 50, 300, 300)
    f = by_what(model_findings(m, env_here), "KV pool")[0]
    assert f.severity == "critical"
    assert "planned 4 blocks x 1,024 B" in f.evidence and "allocated 0.0 MiB" in f.evidence
    report = build_report(env_here, model=m, load_average=IDLE)
    assert report.findings[0] == f  # critical sorts first


def test_slo_and_leak_findings():
    recs = [RequestRecord(float(i), f"r{i}", "t", 100 if i < 50 else 3000, 8, 0, 0.1 if i < 50 else 5.0,
                          0.01, "ok") for i in range(100)]
    risk = measure_risk(recs, SLO(ttft_s=1.0), edges=(0, 1024, 4096))
    found = slo_findings(risk)
    assert found[0].severity == "high" and "1,024-4,095" in found[0].what
    assert "50.0% of requests miss" in found[-1].what
    leak = assess_leak([LeakSample(i, 10**8 + i * 65536) for i in range(1, 101)])
    assert leak_findings(leak)[0].severity == "high"
    clean = assess_leak([LeakSample(i, 10**8) for i in range(1, 101)])
    assert leak_findings(clean)[0].severity == "ok"


def test_cli_doctor_with_a_log_and_leak_samples(tmp_path, cli, monkeypatch):
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(RequestRecord(float(i), f"r{i}", None, 4000, 8, 0, 9.0, 0.01, "ok").to_json() + "\n"
                           for i in range(40)))
    samples = tmp_path / "leak.jsonl"
    samples.write_text("".join(json.dumps({"completed_requests": i, "leak_basis_bytes": 10**8}) + "\n"
                               for i in range(1, 50)))
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    rc, out, _ = cli("doctor", "--log", log, "--ttft", "2s", "--leak-samples", samples)
    assert rc == 0
    text = " ".join(out.split())  # rich wraps long lines
    assert "prompts of 2,048-4,095 tokens miss TTFT <= 2 s" in text
    assert "slow-leak detector: no leak" in text
    assert "OMP_WAIT_POLICY ACTIVE (you set: ACTIVE)" in text
    assert text.index("high prompts of 2,048") < text.index("ok slow-leak detector")  # worst first
