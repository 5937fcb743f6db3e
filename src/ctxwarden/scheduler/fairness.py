"""Fair sharing between tenants (no torch): who goes first, and how much prefill may ride along.

Start-time fair queuing over tenants (keyed by the request's namespace):

    service[t]  = tokens computed for tenant t / weight[t]        (grows as t is served)
    order       = (priority, service[tenant], arrival)            (least-served tenant first)
    activation  : a tenant with no live request starts at the least service among the active
                  ones, a hair below it (history is forgotten while idle; a newcomer goes first)

Ordering alone is not enough for latency: a step that carries a 2,048-token prefill chunk
costs tens of decode steps, and a short request needs one step per token. So while a
less-served tenant has a request decoding, a more-served tenant's prefill may add at most
about one decode step's worth of time to the step (`contended_prefill_tokens`, from the
step-time model fitted to the last steps; `StepRates`). A tenant alone keeps the full
token budget.

Deadline-aware admission predicts a new request's time to first token the way a fair
(GPS) server would serve it: while its tenant's backlog of B tokens (its own prompt
included) is computed, every other tenant t is served min(backlog[t], B * w[t] / w) tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

_DECAY = 0.97  # per observed step: the rates follow the machine within about 30 steps


@dataclass
class StepRates:
    """Measured engine speed: step time = overhead + prefill tokens / rate + decodes * cost.

    A least-squares fit of the last ~30 steps' times against (1, prefill tokens, decoding
    sequences), with exponential forgetting, so a mixed step's time is split between its
    prefill and its decodes instead of being charged to one of them.
    """

    overhead_s: float | None = None  # a step's fixed cost (weights read, Python)
    prefill_tokens_per_s: float | None = None
    decode_seq_s: float = 0.0  # the added cost of one more decoding sequence

    def __post_init__(self):
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3

    def observe(self, num_prefill_tokens: int, num_decode_seqs: int, elapsed_s: float) -> None:
        """Fold one step in and refit."""
        if elapsed_s <= 0 or num_prefill_tokens + num_decode_seqs == 0:
            return
        x = (1.0, float(num_prefill_tokens), float(num_decode_seqs))
        for i in range(3):
            self._xty[i] = _DECAY * self._xty[i] + x[i] * elapsed_s
            for j in range(3):
                self._xtx[i][j] = _DECAY * self._xtx[i][j] + x[i] * x[j]
        self._refit()

    def _refit(self) -> None:
        fit = _solve3([row[:] for row in self._xtx], self._xty[:])
        if fit is None:  # not enough variety yet (e.g. only prefill steps of one size)
            n = self._xtx[0][0]
            if self._xtx[0][1] > 0 and n > 0:
                self.prefill_tokens_per_s = self._xtx[0][1] / self._xty[0]
            return
        a, b, c = fit
        if b > 0:
            self.overhead_s, self.prefill_tokens_per_s, self.decode_seq_s = max(a, 0.0), 1.0 / b, max(c, 0.0)

    def decode_step_s(self, num_decode_seqs: int) -> float | None:
        """Predicted time of a step that only decodes `num_decode_seqs` sequences."""
        if self.overhead_s is None:
            return None
        return self.overhead_s + self.decode_seq_s * max(num_decode_seqs, 1)

    def prefill_tokens_in(self, seconds: float) -> int | None:
        """How many prefill tokens fit in `seconds`, or None before anything was measured."""
        if self.prefill_tokens_per_s is None:
            return None
        return int(self.prefill_tokens_per_s * seconds)


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float] | None:
    """Solve m x = v (3x3) by Gaussian elimination with pivoting; None if singular."""
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-9 * max(1.0, abs(m[0][0])):
            return None
        m[col], m[pivot], v[col], v[pivot] = m[pivot], m[col], v[pivot], v[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            m[r] = [a - f * b for a, b in zip(m[r], m[col])]
            v[r] -= f * v[col]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (v[r] - sum(m[r][k] * x[k] for k in range(r + 1, 3))) / m[r][r]
    return x[0], x[1], x[2]


class FairShare:
    """Virtual service per tenant namespace, and the order and caps that follow from it."""

    def __init__(self):
        self.service: dict[str, float] = {}
        self._num_live: dict[str, int] = {}  # requests waiting or running, per tenant

    def activate(self, namespace: str) -> None:
        """Count a new live request; a tenant coming back from idle joins at the front."""
        if self._num_live.get(namespace, 0) == 0:
            active = [self.service[ns] for ns, n in self._num_live.items() if n > 0 and ns != namespace]
            self.service[namespace] = min(active) - 1e-9 if active else 0.0
        self._num_live[namespace] = self._num_live.get(namespace, 0) + 1

    def deactivate(self, namespace: str) -> None:
        """A live request ended (finished, aborted, refused)."""
        self._num_live[namespace] = max(0, self._num_live.get(namespace, 0) - 1)

    def charge(self, namespace: str, num_tokens: int, weight: float) -> None:
        """Tokens computed for a tenant in a step."""
        self.service[namespace] = self.service.get(namespace, 0.0) + num_tokens / weight

    def key(self, req) -> tuple[int, float, float]:
        """Sort key: explicit priority first, then the least-served tenant, then arrival."""
        return (req.priority, self.service.get(req.namespace, 0.0), req.arrival_s)

    @property
    def num_active_tenants(self) -> int:
        return sum(1 for n in self._num_live.values() if n > 0)

    def is_contended(self, namespace: str, decoding_namespaces: set[str]) -> bool:
        """Whether a less-served tenant than `namespace` has a request decoding this step."""
        mine = self.service.get(namespace, 0.0)
        return any(ns != namespace and self.service.get(ns, 0.0) < mine for ns in decoding_namespaces)

    def predicted_wait_tokens(self, namespace: str, weight: float, num_own_tokens: int,
                              backlog: dict[str, tuple[int, float]]) -> float:
        """Prompt tokens the engine computes before `num_own_tokens` more of this tenant are done.

        `backlog` maps each tenant to (uncomputed prompt tokens, weight); this tenant's own
        entry is its queue ahead of the new request.
        """
        own = backlog.get(namespace, (0, weight))[0] + num_own_tokens
        others = sum(min(tokens, own * w / weight) for ns, (tokens, w) in backlog.items() if ns != namespace)
        return own + others
