"""Diagnostics: what a person needs in an incident, as objects the CLI and server render.

- `lengths`       request-length distributions: candidate models fitted by maximum
                  likelihood, compared by Kolmogorov-Smirnov and AIC, chosen or rejected
- `slo`           SLO risk by prompt-length bucket (Wilson intervals) and a fitted latency
                  model that predicts the risk of a new length mix
- `request_log`   the request log format (JSONL, no text) and readers for logs and CSV traces
- `process_memory`, `cgroup`, `snapshot`   memory snapshots of a process and its cgroup v2,
                  and ranked diffs between two snapshots
- `leaks`         the slow-leak detector (robust slope of RSS against completed requests,
                  TTFT drift adjusted for prompt length) and the glibc `malloc_trim` probe
- `environment`, `doctor`   the environment report and findings {severity, what, evidence, fix}

Nothing here imports torch (a test checks); every module is importable without side effects.
Definitions and JSON formats: docs/diagnostics.md.
"""
