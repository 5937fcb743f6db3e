"""Attention statistics of sampled requests, computed beside the real attention (torch).

`MonitoredAttention` wraps the runner's backend: the backend's output is untouched; for the
sequences the engine marked as sampled (`begin`), the softmax probabilities of each layer are
recomputed in fp32 from the same queries and the same paged keys, under the same masking rule
(attention._allowed, sinks, soft-cap), and reduced at once to per-(layer, head) sums, so
memory stays O(layers x heads) per request (prefill rows are taken every `prefill_stride`):

    entropy    mean over rows i with n_i > 1 visible keys of H_i / log(n_i),
               H_i = -sum_j A_ij log A_ij
    sink_mass  mean over rows of A_i0 (the first token; 0 where it is out of the window)
    alpha      mean of A_i0 over rows at positions >= 1 (Gu et al. 2024: a head is a sink
               head when alpha > 0.3; the sink rate is the share of such heads)

Rows are told apart by position: prompt rows (positions < the prompt's length) and generated
rows (decode). The generated rows' sums are also kept on their own (`generated_*`): a
generated row attends to every earlier key, those of a prefix that came from the prefix
cache included (they are gathered from the same paged pool), so these do not depend on
whether a prefix was cached or recomputed. A cached prefix's own prompt rows are never
computed, so they cannot be observed: `prompt_positions_cached` counts them, and the
all-rows figures cover the prompt rows that were computed. Prefill rows are picked by
position (positions stride - 1, 2 stride - 1, ... and the prompt's last), so chunking does
not change which rows are observed.

With `keep_full=True` (the offline `ctxwarden diag attention`, one whole-prompt prefill) it
also keeps the head-averaged attention rollout (Abnar & Zuidema 2020: R = prod_l (0.5 A_l +
0.5 I), rows renormalised, later layers on the left) and the last row's attention (for the
mass by context decile). Without `begin`, or with no sampled sequence, it costs one branch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ctxwarden.runner.attention import AttentionBackend, _allowed, _gather

SINK_RATE_THRESHOLD = 0.3  # Gu et al.'s epsilon


@dataclass
class RequestAttention:
    """Per-(layer, head) sums of one sampled request (float64, [L, H]) and row counts."""

    num_layers: int
    num_heads: int
    keep_full: bool = False
    entropy_sum: torch.Tensor = None
    entropy_rows: torch.Tensor = None  # [L] rows with > 1 visible key
    sink_sum: torch.Tensor = None
    sink_rows: torch.Tensor = None
    alpha_sum: torch.Tensor = None
    alpha_rows: torch.Tensor = None
    rollout: torch.Tensor | None = None  # [n, n] (keep_full)
    last_row: list = field(default_factory=list)  # per layer: head-averaged last row [m] (keep_full)
    generated_entropy_sum: torch.Tensor = None  # the same sums over generated rows only
    generated_entropy_rows: torch.Tensor = None
    generated_sink_sum: torch.Tensor = None
    generated_sink_rows: torch.Tensor = None
    prompt_positions_cached: int | None = None  # prompt positions before the first computed one

    def __post_init__(self):
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        self.entropy_sum, self.sink_sum, self.alpha_sum = (z(self.num_layers, self.num_heads) for _ in range(3))
        self.entropy_rows, self.sink_rows, self.alpha_rows = (z(self.num_layers) for _ in range(3))
        self.generated_entropy_sum, self.generated_sink_sum = (z(self.num_layers, self.num_heads) for _ in range(2))
        self.generated_entropy_rows, self.generated_sink_rows = (z(self.num_layers) for _ in range(2))

    def add(self, layer: int, probs: torch.Tensor, num_visible: torch.Tensor, query_positions: torch.Tensor,
            first_key_is_token0: bool, num_prompt_tokens: int | None = None) -> None:
        """Fold one layer's probabilities [H, n, m] (rows' visible keys counted in [n]); rows
        at positions >= `num_prompt_tokens` are generated rows (None: all prompt rows)."""
        ent = -torch.special.xlogy(probs, probs).sum(-1)  # [H, n]
        p0 = probs[:, :, 0] if first_key_is_token0 else torch.zeros(probs.shape[:2])
        _fold(self.entropy_sum[layer], self.entropy_rows, self.sink_sum[layer], self.sink_rows, layer,
              ent, p0, num_visible, torch.ones_like(num_visible, dtype=torch.bool))
        later = query_positions >= 1
        self.alpha_sum[layer] += p0[:, later].sum(-1).double()
        self.alpha_rows[layer] += int(later.sum())
        generated = torch.zeros_like(later) if num_prompt_tokens is None else query_positions >= num_prompt_tokens
        if generated.any():
            _fold(self.generated_entropy_sum[layer], self.generated_entropy_rows, self.generated_sink_sum[layer],
                  self.generated_sink_rows, layer, ent, p0, num_visible, generated)

    def add_full(self, probs: torch.Tensor) -> None:
        """Rollout and last row of one layer's whole-prompt probabilities [H, n, n]."""
        mean = probs.mean(0).double()  # heads averaged
        a = 0.5 * mean + 0.5 * torch.eye(mean.shape[0], dtype=torch.float64)
        a = a / a.sum(-1, keepdim=True)
        self.rollout = a if self.rollout is None else a @ self.rollout
        self.last_row.append(mean[-1])

    def entropy(self) -> torch.Tensor:
        """[L, H] mean normalised entropy (NaN for a layer with no row of > 1 key)."""
        return self.entropy_sum / self.entropy_rows[:, None]

    def sink_mass(self) -> torch.Tensor:
        """[L, H] mean attention on the first token over every observed row."""
        return self.sink_sum / self.sink_rows[:, None]

    def alpha(self) -> torch.Tensor:
        """[L, H] mean attention on the first token over rows at positions >= 1."""
        return self.alpha_sum / self.alpha_rows[:, None]

    def generated_entropy(self) -> torch.Tensor:
        """[L, H] mean normalised entropy over generated rows (NaN before the second token)."""
        return self.generated_entropy_sum / self.generated_entropy_rows[:, None]

    def generated_sink_mass(self) -> torch.Tensor:
        """[L, H] mean attention on the first token over generated rows."""
        return self.generated_sink_sum / self.generated_sink_rows[:, None]

    def sink_rate(self) -> float:
        """Share of (layer, head) pairs whose alpha exceeds SINK_RATE_THRESHOLD."""
        return float((self.alpha() > SINK_RATE_THRESHOLD).double().mean())

    def position_mass(self, num_bins: int = 10) -> list[float]:
        """The last row's attention (heads and layers averaged) summed by context decile."""
        if not self.last_row:
            return []
        row = torch.stack(self.last_row).mean(0)
        bins = (torch.arange(row.shape[0]) * num_bins) // row.shape[0]
        return [float(row[bins == b].sum()) for b in range(num_bins)]

    def to_dict(self) -> dict:
        """The JSON of `diag attention --json` (docs/diagnostics.md)."""
        ent, sink = self.entropy(), self.sink_mass()
        layers = [[{"entropy": _num(ent[l, h]), "sink_mass": _num(sink[l, h])} for h in range(self.num_heads)]
                  for l in range(self.num_layers)]
        out = {"layers": layers, "sink_rate": self.sink_rate()}
        if not self.keep_full:  # a live record (the offline JSON keeps its stable keys)
            out.update(self._live_dict())
        if self.rollout is not None:
            out["rollout_last_row"] = [float(x) for x in self.rollout[-1]]
            out["position_mass"] = self.position_mass()
        return out

    def _live_dict(self) -> dict:
        """`prompt_positions_cached` and the generated rows' figures (`generated`: null
        before a second token)."""
        rows = int(self.generated_sink_rows[0]) if self.num_layers else 0
        g_ent, g_sink = self.generated_entropy(), self.generated_sink_mass()
        generated = None if not rows else {"rows": rows, "layers": [
            [{"entropy": _num(g_ent[l, h]), "sink_mass": _num(g_sink[l, h])} for h in range(self.num_heads)]
            for l in range(self.num_layers)]}
        return {"prompt_positions_cached": self.prompt_positions_cached, "generated": generated}


def _fold(entropy_sum, entropy_rows, sink_sum, sink_rows, layer: int, ent, p0, num_visible, rows) -> None:
    """Add the chosen rows' normalised entropies (rows with > 1 visible key) and sink mass."""
    multi = rows & (num_visible > 1)
    if multi.any():
        entropy_sum += (ent[:, multi] / torch.log(num_visible[multi].to(ent.dtype))).sum(-1).double()
        entropy_rows[layer] += int(multi.sum())
    sink_sum += p0[:, rows].sum(-1).double()
    sink_rows[layer] += int(rows.sum())


def _num(x) -> float | None:
    v = float(x)
    return None if math.isnan(v) else v


class MonitoredAttention(AttentionBackend):
    """The inner backend's attention, plus statistics of the sampled sequences."""

    def __init__(self, inner: AttentionBackend, num_layers: int, num_heads: int, prefill_stride: int = 1):
        if prefill_stride < 1:
            raise ValueError(f"prefill_stride must be >= 1, got {prefill_stride}")
        self.inner, self.num_layers, self.num_heads = inner, num_layers, num_heads
        self.prefill_stride = prefill_stride
        self.name = f"{inner.name}+monitor"
        self.records: dict[str, RequestAttention] = {}
        self._sampled: tuple = ()  # per batch sequence: a request id or None
        self._prompt_tokens: tuple = ()  # per batch sequence: its prompt's length or None
        self._layer = 0
        self.keep_full = False  # rollout and last row too (the offline probe)
        self.query_scale = 1.0  # tests scale queries (x10) to provoke a collapse

    def begin(self, sampled: tuple, prompt_tokens: tuple | None = None) -> None:
        """A new step: `sampled[i]` is the request id of batch sequence i if it is monitored,
        `prompt_tokens[i]` its prompt's length (None: every row is a prompt row)."""
        self._sampled, self._layer = tuple(sampled), 0
        self._prompt_tokens = tuple(prompt_tokens) if prompt_tokens is not None else (None,) * len(sampled)
        for rid in sampled:
            if rid is not None and rid not in self.records:
                self.records[rid] = RequestAttention(self.num_layers, self.num_heads, self.keep_full)

    def pop(self, request_id: str) -> RequestAttention | None:
        """The record of a finished request (removed from the monitor)."""
        return self.records.pop(request_id, None)

    def forward(self, q, q_sink, kv, group, params):
        """The inner backend's output; the sampled sequences' statistics on the side."""
        if self.query_scale != 1.0:
            q = q * self.query_scale
            q_sink = None if q_sink is None else q_sink * self.query_scale
        out = self.inner.forward(q, q_sink, kv, group, params)
        layer, self._layer = self._layer, self._layer + 1
        if any(r is not None for r in self._sampled) and layer < self.num_layers:
            self._observe(layer, q, q_sink, kv, group, params)
        return out

    def _observe(self, layer, q, q_sink, kv, group, params) -> None:
        flat_k = kv.key.view(-1, *kv.key.shape[2:])
        for i, rid in enumerate(self._sampled):
            if rid is None:
                continue
            num_prompt = self._prompt_tokens[i]
            rows, qp, slots, kp = _rows_of(group, i, self.prefill_stride, num_prompt)
            rec = self.records[rid]
            if group.decode is None and rec.prompt_positions_cached is None:
                rec.prompt_positions_cached = group.sequences[i].num_computed_tokens  # the first chunk's start
            if qp.numel() == 0:
                continue  # a prefill chunk with no picked position
            probs, visible = _probabilities(q[rows], None if q_sink is None else q_sink[rows],
                                            _gather(flat_k, slots, torch.float32), qp, kp, params)
            rec.add(layer, probs, visible, qp, bool(kp.numel()) and int(kp[0]) == 0, num_prompt)
            if rec.keep_full and probs.shape[1] == probs.shape[2]:
                rec.add_full(probs)


def _rows_of(group, i: int, stride: int, num_prompt_tokens: int | None):
    """Query rows (indices into q), their positions, key slots and key positions of batch
    sequence i (decode: its one row; a chunk: its generated rows, and its prompt rows at
    positions stride - 1, 2 stride - 1, ... and the prompt's last; without
    `num_prompt_tokens`, the chunk's last row stands for the prompt's last)."""
    if group.decode is not None:
        d = group.decode
        valid = d.is_valid[i]
        return slice(i, i + 1), d.query_positions[i:i + 1], d.key_slots[i][valid], d.key_positions[i][valid]
    s = group.sequences[i]
    pos = s.query_positions
    last = pos[-1] if num_prompt_tokens is None else num_prompt_tokens - 1
    keep = ((pos + 1) % stride == 0) | (pos == last) | (pos > last)
    picked = torch.nonzero(keep).flatten()
    return picked + s.query_start, pos[picked], s.key_slots, s.key_positions


def _probabilities(q, q_sink, k, q_pos, k_pos, params):
    """Softmax probabilities [Hq, n, m] in fp32 under the masking rule; visible keys [n]."""
    hq, hkv = q.shape[1], k.shape[1]
    kx = k.repeat_interleave(hq // hkv, dim=1).permute(1, 2, 0)  # [Hq, D, m]
    scores = torch.bmm(q.float().transpose(0, 1), kx)  # [Hq, n, m]
    if q_sink is not None:
        sink_scores = torch.bmm(q_sink.float().transpose(0, 1), kx)
        scores = torch.where((k_pos < params.sink_tokens)[None, None], sink_scores, scores)
    scores = scores * params.scale
    if params.softcap is not None:
        scores = torch.tanh(scores / params.softcap) * params.softcap
    mask = _allowed(q_pos, k_pos, params)  # [n, m]
    probs = torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1)
    return probs, mask.sum(-1)


LIVE_PREFILL_STRIDE = 4  # prefill rows a live request is sampled at (every 4th, and the last)
MAX_FINISHED_RECORDS = 256  # finished requests' records the engine keeps for the server


def attach_monitor(runner, sample_rate: float) -> MonitoredAttention | None:
    """Wrap `runner.backend` in a monitor when `sample_rate` > 0 (else leave it untouched:
    with sampling off the runner runs exactly the code it ran before)."""
    if sample_rate <= 0:
        return None
    spec = runner.spec
    monitor = MonitoredAttention(runner.backend, spec.num_layers, spec.num_attention_heads,
                                 LIVE_PREFILL_STRIDE)
    runner.backend = monitor
    return monitor


def is_sampled(request_id: str, sample_rate: float) -> bool:
    """Whether a request is monitored: a fixed hash of its id under the rate (reproducible)."""
    import zlib

    return sample_rate >= 1.0 or zlib.crc32(request_id.encode()) / 2**32 < sample_rate
