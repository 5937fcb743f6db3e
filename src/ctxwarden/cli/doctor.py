"""`ctxwarden doctor`: environment, plan against measured, SLO risk and leaks, as findings."""

from __future__ import annotations

import argparse
import json

HELP = "The report to read first in an incident: environment, plan vs measured, SLO risk, leaks."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `doctor`."""
    p.add_argument("--model", default=None, help="load this model in a fresh process and measure it")
    p.add_argument("--default-model", action="store_true", help="measure SmolLM2-135M-Instruct (the default)")
    p.add_argument("--kv-memory", default="1GiB", help="--model: the KV pool to allocate (default 1GiB)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--log", default=None, metavar="FILE", help="a request log: add SLO-risk findings")
    p.add_argument("--ttft", default="2s", help="--log: the TTFT objective (default 2s)")
    p.add_argument("--tpot", default=None, help="--log: the TPOT objective, e.g. 100ms")
    p.add_argument("--leak-samples", default=None, metavar="FILE", help="leak samples: add the leak verdict")
    p.add_argument("--leak-warmup", type=int, default=0, help="--leak-samples: ignore the first N requests")
    from ctxwarden.cli.diag.mem import add_url_arguments

    add_url_arguments(p)
    p.add_argument("--cgroup-root", default="/sys/fs/cgroup", help="where the cgroup hierarchy is mounted")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    """Collect every source asked for, build the findings, render."""
    from ctxwarden.cli import USER_ENV
    from ctxwarden.diagnostics.doctor import build_report
    from ctxwarden.diagnostics.environment import collect_environment

    env = collect_environment(args.cgroup_root, user_env=USER_ENV)
    model = _measure(args) if (args.model or args.default_model) else None
    server = None
    if args.url:
        from ctxwarden.cli.diag.mem import fetch_server_json

        server = fetch_server_json(args.url, "/debug/memory", args.api_key)
    report = build_report(env, model=model, slo_risk=_slo(args), leak=_leak(args), server=server)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _render(report)
    return 0


def _measure(args):
    import subprocess
    import sys

    from ctxwarden.diagnostics.doctor import ModelMeasurement

    cmd = [sys.executable, "-m", "ctxwarden.cli._doctor_probe", "--kv-memory", args.kv_memory, "--dtype", args.dtype]
    cmd += ["--model", args.model] if args.model else []
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"measuring the model failed: {last}")
    return ModelMeasurement(**json.loads(out.stdout))


def _slo(args):
    if not args.log:
        return None
    from ctxwarden.cli.diag._args import parse_duration_s
    from ctxwarden.diagnostics.request_log import read_request_log
    from ctxwarden.diagnostics.slo import SLO, measure_risk

    slo = SLO(parse_duration_s(args.ttft), parse_duration_s(args.tpot) if args.tpot else None)
    return measure_risk(read_request_log(args.log), slo)


def _leak(args):
    if not args.leak_samples:
        return None
    from ctxwarden.cli.diag.leak import _read_samples
    from ctxwarden.diagnostics.leaks import assess_leak

    return assess_leak(_read_samples(args.leak_samples), warmup_requests=args.leak_warmup)


_STYLE = {"critical": "bold red", "high": "red", "warning": "yellow", "info": "cyan", "ok": "green"}


def _render(report) -> None:
    from rich.console import Console

    c = Console()
    e = report.environment
    c.print(f"[bold]environment[/bold]: Python {e.python['version']}, torch {e.torch.get('version', '?')} "
            f"({e.torch.get('num_threads', '?')} threads, {e.torch.get('parallel_backend', '?')}), "
            f"{e.threads['cpus_allowed']} CPUs allowed, OMP_WAIT_POLICY {e.openmp_wait_policy or 'unset'} "
            f"(you set: {e.openmp_wait_policy_user or 'unset'}), {e.cpu.get('model')}")
    for f in report.findings:
        c.print(f"[{_STYLE[f.severity]}]{f.severity:>8}[/] [bold]{f.what}[/bold]")
        c.print(f"          evidence: {f.evidence}", highlight=False)
        c.print(f"          fix: {f.fix}", highlight=False)
