"""The request log (JSONL, one finished request a line, never any text) and length readers.

A line: {"time": unix seconds at arrival, "request_id", "tenant", "prompt_tokens",
"completion_tokens", "cached_tokens", "ttft_s", "tpot_s", "status"}; `ttft_s` and `tpot_s`
are null when no token (or only one) came back; `status` is "ok", "error" or "abort".
The server writes it (phase 2 of issue 14); `benchmarks/replay_trace.py` writes the same
format from the client side. Length readers also take a CSV trace with a token-count column
(the Azure 2023 traces: `ContextTokens`, `GeneratedTokens`).
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass
from pathlib import Path

STATUSES = ("ok", "error", "abort")
CSV_DEFAULT_COLUMN = "ContextTokens"
LOG_DEFAULT_FIELD = "prompt_tokens"


@dataclass(frozen=True)
class RequestRecord:
    """One finished request as the log stores it (no prompt or completion text, ever)."""

    time: float
    request_id: str
    tenant: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    status: str

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"request {self.request_id}: status must be one of {STATUSES}, "
                             f"got {self.status!r}")
        if min(self.prompt_tokens, self.completion_tokens, self.cached_tokens) < 0:
            raise ValueError(f"request {self.request_id}: token counts must be >= 0")

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens that prefill had to compute (the rest came from the prefix cache)."""
        return self.prompt_tokens - min(self.cached_tokens, self.prompt_tokens)

    def to_json(self) -> str:
        """One JSONL line."""
        return json.dumps(asdict(self), separators=(",", ":"))


def read_request_log(path: str | Path) -> list[RequestRecord]:
    """Every record of a JSONL request log; a malformed line is an error naming its number."""
    records = []
    with open(path, encoding="utf-8") as f:
        for num, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(RequestRecord(**json.loads(line)))
            except (json.JSONDecodeError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{num}: not a request-log record ({e}); see "
                                 "docs/diagnostics.md for the fields") from None
    if not records:
        raise ValueError(f"{path}: the request log has no records")
    return records


def is_csv(path: str | Path) -> bool:
    """A .csv suffix means a trace with a header row; anything else is read as JSONL."""
    return Path(path).suffix.lower() == ".csv"


def read_lengths(path: str | Path, column: str | None = None) -> list[int]:
    """Token counts from a request log (default field `prompt_tokens`) or a CSV trace
    (default column `ContextTokens`)."""
    if is_csv(path):
        return _csv_column(path, column or CSV_DEFAULT_COLUMN)
    field = column or LOG_DEFAULT_FIELD
    records = read_request_log(path)
    if not hasattr(records[0], field) or field in ("request_id", "tenant", "status"):
        raise ValueError(f"{path}: request-log records have no numeric field {field!r}; use one "
                         "of prompt_tokens, completion_tokens, cached_tokens")
    return [getattr(r, field) for r in records]


def _csv_column(path: str | Path, column: str) -> list[int]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if column not in (reader.fieldnames or []):
            raise ValueError(f"{path}: no column {column!r}; the header has {reader.fieldnames}. "
                             "Pick one with --column")
        try:
            return [int(float(row[column])) for row in reader]
        except ValueError as e:
            raise ValueError(f"{path}: column {column!r} holds a non-number ({e})") from None
