"""`ctxwarden doctor`: the report a person reads first in an incident, as findings.

Each finding is {"severity", "what", "evidence", "fix"}: severity one of SEVERITIES (worst
first), `what` one line, `evidence` the numbers it rests on, `fix` what to do. Findings come
from the environment, from a model loaded and measured in a fresh process (plan against
measured), from a request log (SLO risk) and from leak samples; each source is optional
except the environment.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from ctxwarden.diagnostics.environment import Environment

SEVERITIES = ("critical", "high", "warning", "info", "ok")
HEADROOM_HIGH, HEADROOM_WARNING = 0.10, 0.25  # share of the limit still free
UNEXPLAINED_WARNING = 0.25  # RSS beyond weights + KV pool, as a share of them
MiB, GiB = 2**20, 2**30


@dataclass(frozen=True)
class Finding:
    """One thing the doctor noticed, with its numbers and the fix."""

    severity: str
    what: str
    evidence: str
    fix: str

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")


@dataclass(frozen=True)
class ModelMeasurement:
    """A model loaded in a fresh process (ctxwarden.cli._doctor_probe), planned vs measured."""

    model: str
    format: str
    dtype: str
    weights_planned_bytes: int | None  # what the planner counts (the runtime layout where modeled)
    weights_loaded_bytes: int  # tensors the runner holds
    kv_planned_bytes: int
    kv_allocated_bytes: int
    num_blocks: int
    page_bytes: int
    load_s: float
    ttft_s: float | None
    rss_before_torch_bytes: int
    rss_baseline_bytes: int  # after importing torch, before loading
    rss_loaded_bytes: int
    rss_anon_loaded_bytes: int
    rss_file_loaded_bytes: int
    rss_anon_baseline_bytes: int
    rss_file_baseline_bytes: int
    rss_after_request_bytes: int
    peak_rss_bytes: int
    weights_plan_source: str = ""  # plan/checkpoint_plan.py planned_weights' source


@dataclass(frozen=True)
class DoctorReport:
    """Environment, findings (worst first) and the model measurement when one was made."""

    environment: Environment
    findings: tuple[Finding, ...]
    model: ModelMeasurement | None = None

    def to_dict(self) -> dict:
        """`doctor --json`: {"environment", "findings", "model"} (docs/diagnostics.md)."""
        return {"environment": self.environment.to_dict(), "findings": [asdict(f) for f in self.findings],
                "model": asdict(self.model) if self.model else None}


def build_report(env: Environment, model: ModelMeasurement | None = None, slo_risk=None,
                 leak=None, load_average: tuple[float, float, float] | None = None,
                 server: dict | None = None) -> DoctorReport:
    """Collect the findings of every source given, worst first (`server`: the snapshot JSON
    of a running server's /debug/memory)."""
    findings = environment_findings(env, load_average or os.getloadavg())
    if server is not None:
        findings += server_findings(server)
    if model is not None:
        findings += model_findings(model, env)
    if slo_risk is not None:
        findings += slo_findings(slo_risk)
    if leak is not None:
        findings += leak_findings(leak)
    return DoctorReport(env, tuple(sorted(findings, key=lambda f: SEVERITIES.index(f.severity))), model)


# --- environment ----------------------------------------------------------------------------


def environment_findings(env: Environment, load_average: tuple[float, float, float]) -> list[Finding]:
    """OpenMP policy, threads, CPU features, memory limits and pressure."""
    return [*_wait_policy(env, load_average), *_threads(env), *_cpu_features(env), *_kernels(),
            *_memory_limit(env), *_memory_events(env), *_machine_memory(env)]


def _cpus(env: Environment) -> float:
    quota = env.threads.get("cpu_quota")
    return min(env.threads["cpus_allowed"], quota) if quota else env.threads["cpus_allowed"]


def _wait_policy(env: Environment, load_average) -> list[Finding]:
    policy = (env.openmp_wait_policy or "").upper() or None
    load, cpus = load_average[0], _cpus(env)
    evidence = f"OMP_WAIT_POLICY={policy or 'unset'}; load average {load:.2f} on {cpus:g} CPUs"
    if policy in (None, "ACTIVE") and load > 0.5 * cpus:
        return [Finding("warning", "OpenMP threads spin while the CPUs are shared", evidence,
                        "export OMP_WAIT_POLICY=PASSIVE (spinning threads stall ~100 ms whenever another "
                        "process holds a core); keep spinning only on dedicated cores")]
    if policy == "PASSIVE":
        if env.openmp_wait_policy_user is None:
            evidence += ("; set by the ctxwarden CLI (unset in your shell: your own Python programs "
                         "that import ctxwarden spin)")
        return [Finding("info", "OpenMP threads sleep while waiting (PASSIVE)", evidence,
                        "right on shared cores; on dedicated cores OMP_WAIT_POLICY=ACTIVE decodes "
                        "about 1.2x faster (README: 45 vs 55 ms/token at batch 1)")]
    return [Finding("ok", "OpenMP threads spin on idle CPUs", evidence,
                    "fine while the cores are yours; set PASSIVE if other jobs share them")]


def _threads(env: Environment) -> list[Finding]:
    torch_threads, cpus = env.torch.get("num_threads"), _cpus(env)
    if torch_threads is None:
        return [Finding("warning", "torch could not be asked for its threads", env.torch.get("error", "?"),
                        "check the torch install (`pip install -c constraints.txt torch`)")]
    evidence = (f"torch {env.torch.get('version')}: {torch_threads} threads; {env.threads['cpus_allowed']} CPUs "
                f"allowed, cgroup quota {env.threads.get('cpu_quota') or 'none'}")
    if torch_threads > cpus:
        return [Finding("warning", "more torch threads than CPUs: they preempt each other", evidence,
                        f"export OMP_NUM_THREADS={int(cpus)} (or torch.set_num_threads) before starting")]
    return [Finding("ok", "torch threads match the CPUs", evidence, "nothing to do")]


def _cpu_features(env: Environment) -> list[Finding]:
    flags = env.cpu.get("flags", {})
    have = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if flags.get(f)]
    evidence = f"{env.cpu.get('model')}; {', '.join(have) or 'no AVX-512'}; ATen {env.torch.get('cpu_capability')}"
    if not flags.get("avx512f"):
        # not a speed warning: an AVX2 EPYC ran fp32 GEMMs at 135-141 GFLOP/s, above the
        # AVX-512 Zen 4's 80-86 (PERF-NOTES); only bf16 loses its hardware
        return [Finding("info", "no AVX-512: bf16 matmuls are emulated, keep fp32 / auto", evidence,
                        "use --weights auto or fp32; compare speed only with runs on this machine")]
    if flags.get("amx_bf16") or flags.get("avx512_bf16"):
        return [Finding("info", "bf16 matmuls run in hardware (AVX512-BF16 / AMX)", evidence,
                        "--dtype bfloat16 speeds prefill; batch-1 decode stays faster in fp32 (PERF-NOTES)")]
    return [Finding("info", "no bf16 hardware: bf16 matmuls are slower than fp32", evidence, "keep --dtype float32")]


def _kernels() -> list[Finding]:
    from ctxwarden.ext import built_library, simd_level

    level = simd_level()
    if level == "not built":
        why = "disabled by CTXWARDEN_NO_EXT" if os.environ.get("CTXWARDEN_NO_EXT") else (
            "not built" if built_library() is None else "built from an older kernels.cpp, or failed to load")
        return [Finding("warning", "ctxwarden's C++ kernels are not in use: decode runs on plain torch ops",
                        why, "run `make install` (or `python -m ctxwarden.ext.build`) with a C++ compiler")]
    if level == "none":
        return [Finding("warning", "the C++ kernels have no vector path on this CPU: quantized weights are "
                        "dequantized at load", f"built for: {level}", "expect fp32 weight size and speed")]
    return [Finding("ok", f"C++ kernels built with {level}", f"built for: {level}", "nothing to do")]


def _memory_limit(env: Environment) -> list[Finding]:
    cg = env.cgroup
    if cg is None:
        return [Finding("info", "no memory cgroup could be read", env.cgroup_note or "?",
                        "limits are unknown: the machine total applies")]
    limit, current = cg["memory_max_bytes"], cg["memory_current_bytes"]
    if limit is None:
        return [Finding("info", "no memory limit on this cgroup", f"cgroup v{cg['version']} {cg['path']}; "
                        f"machine total {env.memory['total_bytes'] / GiB:.1f} GiB"
                        + (f"; {env.cgroup_note}" if env.cgroup_note else ""),
                        "the OOM killer picks from the whole machine: set a limit that covers the plan")]
    free = (limit - current) / limit
    evidence = f"memory.current {current / GiB:.2f} GiB of memory.max {limit / GiB:.2f} GiB ({free:.0%} free)"
    if free < HEADROOM_HIGH:
        return [Finding("high", "the cgroup is about to hit memory.max", evidence,
                        "shrink --kv-memory or raise memory.max before the OOM killer acts")]
    severity = "warning" if free < HEADROOM_WARNING else "ok"
    return [Finding(severity, "memory headroom to memory.max", evidence,
                    "keep the KV pool plus weights well inside memory.max" if severity != "ok" else "nothing to do")]


def _memory_events(env: Environment) -> list[Finding]:
    cg = env.cgroup or {}
    out = []
    kills = cg.get("events", {}).get("oom_kill", 0)
    if kills:
        out.append(Finding("high", "processes in this cgroup were OOM-killed", f"memory.events oom_kill {kills}",
                           "run `ctxwarden diag mem snapshot` now and after load; lower --kv-memory"))
    some = ((cg.get("pressure") or {}).get("some") or {}).get("avg60", 0.0)
    if some > 10.0:
        out.append(Finding("warning", "tasks stall on memory (PSI)", f"memory.pressure some avg60 {some:.1f}% "
                           f"({cg.get('pressure_scope')})", "the page cache is thrashing: free memory or "
                           "lower --kv-memory so weights stay resident"))
    return out


def _machine_memory(env: Environment) -> list[Finding]:
    m = env.memory
    out = []
    if m["swap_used_bytes"]:
        out.append(Finding("warning", "swap is in use", f"{m['swap_used_bytes'] / MiB:,.0f} MiB swapped",
                           "swapped KV or weights make TTFT unpredictable: lower --kv-memory or add RAM"))
    if m["available_bytes"] < 0.1 * m["total_bytes"]:
        out.append(Finding("warning", "the machine is nearly out of memory",
                           f"{m['available_bytes'] / GiB:.1f} of {m['total_bytes'] / GiB:.1f} GiB available",
                           "find the largest process (`ctxwarden diag mem snapshot --pid`)"))
    return out


# --- a model, planned against measured ------------------------------------------------------


def model_findings(m: ModelMeasurement, env: Environment) -> list[Finding]:
    """KV pool and weights against the plan, unexplained RSS, headroom for the loaded model."""
    return [_kv_pool(m), _weights(m), _unexplained(m), *_model_headroom(m, env), *_load_peak(m)]


def _kv_pool(m: ModelMeasurement) -> Finding:
    evidence = (f"planned {m.num_blocks:,} blocks x {m.page_bytes:,} B = {m.kv_planned_bytes / MiB:,.1f} MiB; "
                f"allocated {m.kv_allocated_bytes / MiB:,.1f} MiB")
    if m.kv_planned_bytes == m.kv_allocated_bytes:
        return Finding("ok", "KV pool: planned == allocated", evidence, "nothing to do")
    return Finding("critical", "KV pool differs from its plan", evidence,
                   "a planner/runner mismatch: admission will accept what the pool cannot hold; report it")


def _weights(m: ModelMeasurement) -> Finding:
    if m.weights_planned_bytes is None:
        return Finding("info", "weights were not planned from headers", f"loaded {m.weights_loaded_bytes / MiB:,.1f} MiB",
                       "plan with the checkpoint's weight files present")
    ratio = m.weights_loaded_bytes / m.weights_planned_bytes
    evidence = (f"the plan counts {m.weights_planned_bytes / MiB:,.1f} MiB ({m.weights_plan_source or m.format}); "
                f"the runner holds {m.weights_loaded_bytes / MiB:,.1f} MiB in {m.dtype} ({ratio:.2f}x)")
    if ratio <= 1.02:
        return Finding("ok", "weights: planned == loaded", evidence, "nothing to do")
    return Finding("warning", "weights take more memory than the plan counts", evidence,
                   f"budget {m.weights_loaded_bytes / MiB:,.0f} MiB for weights (the plan counts the stored "
                   "bytes where plan/weights.py does not model the family's runtime layout; report the gap)")


def _unexplained(m: ModelMeasurement) -> Finding:
    grown = m.rss_loaded_bytes - m.rss_baseline_bytes
    expected = m.weights_loaded_bytes + m.kv_allocated_bytes
    extra = grown - expected
    evidence = (f"RSS grew {grown / MiB:,.1f} MiB on load (anon +{(m.rss_anon_loaded_bytes - m.rss_anon_baseline_bytes) / MiB:,.1f}, "
                f"file +{(m.rss_file_loaded_bytes - m.rss_file_baseline_bytes) / MiB:,.1f}); weights + KV pool "
                f"{expected / MiB:,.1f} MiB; torch itself {(m.rss_baseline_bytes - m.rss_before_torch_bytes) / MiB:,.1f} MiB")
    if extra > UNEXPLAINED_WARNING * expected + 64 * MiB:
        return Finding("warning", "memory beyond weights + KV pool after load", evidence + f"; {extra / MiB:,.1f} MiB unexplained",
                       "snapshot before and after load (`ctxwarden diag mem diff`) to see what grew")
    if extra < -0.5 * m.kv_allocated_bytes:
        return Finding("info", "KV pool pages not resident yet", evidence,
                       "RSS grows to the plan as the pool fills: budget for the full pool")
    return Finding("ok", "RSS after load = torch + weights + KV pool (within 25%)", evidence, "nothing to do")


def _model_headroom(m: ModelMeasurement, env: Environment) -> list[Finding]:
    cg = env.cgroup or {}
    limit = cg.get("memory_max_bytes") or env.memory["total_bytes"]
    source = "memory.max" if cg.get("memory_max_bytes") else "machine RAM"
    need = max(m.rss_after_request_bytes, m.rss_baseline_bytes + m.weights_loaded_bytes + m.kv_allocated_bytes)
    used = need / limit
    evidence = f"one server process needs {need / GiB:.2f} GiB of {source} {limit / GiB:.2f} GiB ({used:.0%})"
    if used > 1 - HEADROOM_HIGH:
        return [Finding("high", "the loaded model leaves almost no headroom", evidence, "lower --kv-memory")]
    if used > 1 - HEADROOM_WARNING:
        return [Finding("warning", "little headroom for the loaded model", evidence, "lower --kv-memory a little")]
    return [Finding("ok", "headroom for the loaded model", evidence, "nothing to do")]


def _load_peak(m: ModelMeasurement) -> list[Finding]:
    if m.peak_rss_bytes <= 1.2 * m.rss_after_request_bytes:
        return []
    return [Finding("info", "loading peaks above the steady state",
                    f"peak RSS {m.peak_rss_bytes / MiB:,.0f} MiB vs {m.rss_after_request_bytes / MiB:,.0f} MiB after load",
                    "the memory limit must cover the load peak, not only the steady state")]


# --- request log and leak samples -----------------------------------------------------------


def slo_findings(risk) -> list[Finding]:
    """Buckets whose violation probability is surely above 5% (Wilson lower bound), worst first."""
    slo = risk.slo
    target = f"TTFT <= {slo.ttft_s:g} s" + (f", TPOT <= {slo.tpot_s * 1000:g} ms" if slo.tpot_s else "")
    out = []
    for b in sorted(risk.buckets, key=lambda b: -b.p_violation):
        if b.p_low > 0.05:
            severity = "high" if b.p_low > 0.5 else "warning"
            out.append(Finding(severity, f"prompts of {b.lo_tokens:,}-{b.hi_tokens - 1:,} tokens miss {target}",
                               f"P(violation) {b.p_violation:.1%} (95% {b.p_low:.1%}-{b.p_high:.1%}), "
                               f"{b.share_of_traffic:.1%} of traffic, {b.share_of_violations:.1%} of all violations",
                               "give this bucket its own SLO or capacity, cap prompt length at the door, or "
                               "lower --max-batched-tokens so long prefills do not block others"))
    rate = risk.num_violations / risk.num_requests
    out.append(Finding("ok" if not out else "info", f"{rate:.1%} of requests miss {target}",
                       f"{risk.num_violations:,} of {risk.num_requests:,} requests", "see `ctxwarden diag slo-risk`"))
    return out


def leak_findings(report) -> list[Finding]:
    """The slow-leak verdict and TTFT drift as findings."""
    severity = {"leak": "high", "allocator retention": "warning", "inconclusive": "info", "no leak": "ok"}[report.verdict]
    fix = {"leak": "diff two snapshots (`ctxwarden diag mem diff`) to see which figure grows",
           "allocator retention": "MALLOC_ARENA_MAX=2 or a periodic malloc_trim returns it",
           "inconclusive": "skip the warm-up (caches filling) with `diag leak --warmup N` / `doctor "
                           "--leak-warmup N`, or collect more samples",
           "no leak": "nothing to do"}[report.verdict]
    out = [Finding(severity, f"slow-leak detector: {report.verdict}", report.reason, fix)]
    d = report.ttft
    if d is not None and d.low > 0:
        out.append(Finding("warning", "TTFT drifts up at a fixed prompt length",
                           f"{d.seconds_per_1000_requests * 1000:+.1f} ms per 1,000 requests "
                           f"({d.low * 1000:+.1f} to {d.high * 1000:+.1f}); median TTFT {d.median_ttft_s * 1000:.1f} ms",
                           "look for per-request state that accumulates (caches, queues, fragmentation)"))
    return out


# --- a running server (its /debug/memory snapshot) ---------------------------------------------

FRAGMENTATION_WARNING = 0.5  # external fragmentation of the allocatable blocks
_OWNER_FIX = {"HIGH": "a finished request still holds KV blocks: a release path missed it; restart the server to "
                      "get the blocks back and report the request id (its events: `ctxwarden diag timeline`)",
              "CRITICAL": "KV blocks are held with no request known to own them: restart the server and report "
                          "the snapshot (`ctxwarden diag mem snapshot --url URL --json`)"}


def server_findings(snap: dict) -> list[Finding]:
    """KV owners at risk, the pool's use and fragmentation, from a server's snapshot."""
    out = [*_owner_findings(snap.get("owners") or [])]
    kv = snap.get("kv")
    if kv:
        share = kv["num_blocks_in_use"] / kv["num_blocks_total"] if kv["num_blocks_total"] else 0.0
        out.append(Finding("info", "KV pool use on the server",
                           f"{kv['num_blocks_in_use']:,} of {kv['num_blocks_total']:,} blocks in use ({share:.0%}), "
                           f"{kv['num_blocks_cached']:,} cached, host swap {kv['host_swap_bytes'] / MiB:,.1f} MiB",
                           "nothing to do" if share < 0.9 else "near full: requests queue or preempt; "
                           "a larger --kv-memory or fewer --max-num-seqs"))
        if kv["external_fragmentation"] > FRAGMENTATION_WARNING:
            out.append(Finding("warning", "the free KV blocks are fragmented",
                               f"external fragmentation {kv['external_fragmentation']:.0%}",
                               "harmless for paged attention (any free block serves); watch it only with "
                               "contiguous tiers or swap"))
    if not any(o.get("risk") in ("HIGH", "CRITICAL") for o in snap.get("owners") or []):
        out.append(Finding("ok", "no KV blocks held by finished or unknown requests",
                           f"{len(snap.get('owners') or [])} owner(s), all live", "nothing to do"))
    if "leak_slope" in snap:
        out.append(_server_slope_finding(snap["leak_slope"]))
    return out


# A live server's clean traffic read up to 11 KiB per request (tiny model, the test client
# in the same process; not attributed): below this floor the gauge still shows a slope, but
# doctor does not call it a leak (16 KiB/request at 1 request/s is 56 MiB/hour).
SERVER_MIN_SLOPE_BYTES = 16 * 1024


def _server_slope_finding(slope: dict | None) -> Finding:
    """The server's own slow-leak slope (its 1 Hz samples against completed requests)."""
    if slope is None:
        return Finding("info", "server slow-leak slope: not fitted yet", "fewer than 10 distinct counts of "
                       "completed requests after the warm-up (serve --leak-warmup-requests)",
                       "look again after more traffic (it is refitted every 10 samples)")
    from dataclasses import fields

    from ctxwarden.diagnostics.leaks import SlopeFit, slope_verdict

    verdict, reason = slope_verdict(SlopeFit(**{f.name: slope[f.name] for f in fields(SlopeFit)}),
                                    min_slope_bytes=SERVER_MIN_SLOPE_BYTES)
    severity = {"leak": "high", "inconclusive": "info", "no leak": "ok"}[verdict]
    fix = {"leak": "diff two snapshots (`ctxwarden diag mem diff`) to see which figure grows",
           "inconclusive": "a step (caches filling) or noise: look again later, or raise --leak-warmup-requests",
           "no leak": "nothing to do"}[verdict]
    return Finding(severity, f"server memory per completed request: {verdict}",
                   f"{reason}; requests {slope['first_completed']:,}-{slope['last_completed']:,}", fix)


def _owner_findings(owners: list[dict]) -> list[Finding]:
    out = []
    for risk, severity in (("CRITICAL", "critical"), ("HIGH", "high")):
        bad = sorted((o for o in owners if o.get("risk") == risk), key=lambda o: -o["age_s"])
        if not bad:
            continue
        shown = "; ".join(f"{o['request_id'] or o.get('engine_request_id') or 'no sequence'} (tenant "
                          f"{o['tenant'] or '-'}, {o['blocks']} blocks, {o['state']} {o['age_s']:.1f} s ago)"
                          for o in bad[:5])
        more = f"; and {len(bad) - 5} more" if len(bad) > 5 else ""
        out.append(Finding(severity, f"{sum(o['blocks'] for o in bad):,} KV blocks held by "
                           f"{len(bad)} {'unknown' if risk == 'CRITICAL' else 'finished'} owner(s)",
                           shown + more, _OWNER_FIX[risk]))
    return out
