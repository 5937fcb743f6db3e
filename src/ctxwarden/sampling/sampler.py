"""Logits -> tokens for one engine step: penalties, greedy / random sampling, logprobs.

Algorithm (one call per step, all running requests at once):
1. Penalties edit a copy of the rows that ask for them (per row: their token lists differ).
2. Greedy rows take the exact argmax of those logits.
3. Random rows, as one batch with per-row parameter vectors:
   logits / temperature -> top-k mask -> softmax -> top-p mask -> min-p mask, then one
   inverse-CDF draw per row. Its single uniform comes from the row's own torch.Generator
   and every other op is row-wise, so a seeded request draws the same tokens whatever else
   shares its batch. (An exponential race, argmax(p / q), needs a vocab-sized draw per row
   per step: 8x slower here for the same distribution.)
4. Logprobs are reported from the RAW model logits (log-softmax before penalties,
   temperature and filters), as vLLM and the OpenAI API do by default: they describe the
   model, not the sampling settings. The chosen token's logprob is always returned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ctxwarden.ext import kernels
from ctxwarden.sampling.params import SamplingParams
from ctxwarden.sampling.penalties import apply_penalties

_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15  # golden-ratio increment: spreads sample indices apart
_TOP_P_CANDIDATES = 1024  # top-p looks for its cutoff here before sorting a whole row
_CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF
_PROMPT_LOGPROB_CHUNK_ROWS = 512  # bounds the temporaries of long prompts (32K x 49K is 6 GB)


def make_generator(seed: int | None, sample_index: int = 0,
                   device: str | torch.device = "cpu") -> torch.Generator:
    """A request's own random stream: seeded from `seed`, or from OS entropy when None.

    `sample_index` separates the n samples of one request (index 0 uses the seed as is);
    seeds of any size or sign are reduced modulo 2**64, the range torch accepts. Create it on
    the device the logits live on.
    """
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed((seed + sample_index * _SPLITMIX_GAMMA) % 2**64)
    return generator


@dataclass(frozen=True)
class SamplingRow:
    """One row of the logits batch: whose params, which tokens so far, whose random stream."""

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None  # required unless params.is_greedy

    def __post_init__(self) -> None:
        if self.generator is None and not self.params.is_greedy:
            raise ValueError(
                f"SamplingRow with temperature {self.params.temperature} needs a generator: "
                "pass make_generator(params.seed) (one per request, kept across steps)."
            )


@dataclass(frozen=True)
class TokenLogprob:
    """A token and its log-probability under the raw model distribution."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class ScoredToken:
    """A chosen (or prompt) token, its logprob, and the top alternatives when asked for."""

    token_id: int
    logprob: float
    top_logprobs: tuple[TokenLogprob, ...] = ()  # most likely first


@dataclass(frozen=True)
class SampleResult:
    """The step's tokens, one per input row, in row order."""

    tokens: tuple[ScoredToken, ...]

    @property
    def token_ids(self) -> list[int]:
        """Chosen token id of each row."""
        return [t.token_id for t in self.tokens]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, row: int) -> ScoredToken:
        return self.tokens[row]


class Sampler:
    """Stateless: all per-request state (token lists, generator) travels in SamplingRow."""

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
        """Choose one token per row of `logits` ([num_rows, vocab], raw model output)."""
        _check_batch(logits, rows)
        logits = logits.float()  # no copy when already fp32
        work = _penalised(logits, rows)
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        stats = _max_lse(logits)
        num_top = [row.params.logprobs or 0 for row in rows]
        if len(greedy) == len(rows) and stats is not None and work is logits and not any(num_top):
            # the common decode step: the argmax, its logprob and nothing else, from one
            # ext/ pass per row (torch's argmax + logsumexp cost 0.1-0.3 ms a row here)
            return SampleResult(tuple(ScoredToken(int(i), mx - lse) for i, mx, lse in stats))
        if len(greedy) == len(rows):  # one vectorised argmax
            token_ids = work.argmax(dim=-1)
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            if greedy:
                token_ids[greedy] = work[greedy].argmax(dim=-1)
            rand = [i for i, row in enumerate(rows) if not row.params.is_greedy]
            token_ids[rand] = _sample_random(work[rand], [rows[i] for i in rand])
        return SampleResult(_score(logits, token_ids, num_top, stats))


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: Sequence[int],
                    num_top: int) -> list[ScoredToken]:
    """Score each prompt token after the first: entry i is prompt_token_ids[i + 1].

    `logits` are the prefill logits ([prompt_len or prompt_len - 1, vocab]); row i predicts
    token i + 1, so the first prompt token has no logprob (OpenAI reports it as null).
    Computed in chunks of rows so that long prompts do not double their logits' memory.
    """
    num_scored = len(prompt_token_ids) - 1
    if logits.dim() != 2 or logits.shape[0] < num_scored:
        raise ValueError(
            f"prompt_logprobs needs logits of shape [>= {num_scored}, vocab] for a "
            f"{len(prompt_token_ids)}-token prompt, got {tuple(logits.shape)}."
        )
    targets = torch.as_tensor(list(prompt_token_ids[1:]), dtype=torch.long, device=logits.device)
    scored: list[ScoredToken] = []
    for start in range(0, num_scored, _PROMPT_LOGPROB_CHUNK_ROWS):
        stop = min(start + _PROMPT_LOGPROB_CHUNK_ROWS, num_scored)
        block = logits[start:stop].float()
        scored.extend(_score(block, targets[start:stop], [num_top] * (stop - start), _max_lse(block)))
    return scored


def _check_batch(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows) or not logits.is_floating_point():
        raise ValueError(
            f"Sampler.sample needs float logits of shape [num_rows={len(rows)}, vocab], got "
            f"{tuple(logits.shape)} {logits.dtype}: pass one SamplingRow per logits row."
        )


def _penalised(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The logits to sample from: a copy with penalties applied, or the input itself."""
    penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalised:
        return logits
    work = logits.clone()
    for i in penalised:
        row = rows[i]
        work[i] = apply_penalties(logits[i], row.params, row.prompt_token_ids,
                                  row.output_token_ids)
    return work


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One draw per row from the filtered, temperature-scaled distribution."""
    # logits: [m, V]; every parameter becomes a [m, 1] column so mixed params stay batched
    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=logits.device).unsqueeze(1)

    params = [row.params for row in rows]
    scaled = logits / column([p.temperature for p in params])
    if any(p.top_k_enabled for p in params):
        scaled = _mask_top_k(scaled, [p.top_k if p.top_k_enabled else 0 for p in params])
    probs = scaled.softmax(dim=-1)
    if any(p.top_p < 1.0 for p in params):
        threshold = _top_p_threshold(probs, [p.top_p for p in params])
        probs = probs.masked_fill(probs < threshold, 0.0)
    if any(p.min_p > 0.0 for p in params):
        threshold = column([p.min_p for p in params]) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return _draw(probs, [row.generator for row in rows])


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Inverse-CDF draw: one uniform per row from that row's generator.

    Two levels, so that no running sum over the whole vocabulary is kept in fp32 (which
    would lose the tail tokens' share next to a sum near 1) and no [m, V] fp64 copy is
    made (6x slower): pick a block of `_CDF_BLOCK` tokens by the fp64 CDF of block masses,
    then a token inside it. A token with p = 0 never raises a CDF, so `searchsorted(right)`
    can never land on it.
    """
    # probs: [m, V], need not be normalised (the uniform is scaled by each row's total)
    num_rows, vocab_size = probs.shape
    blocks = torch.nn.functional.pad(probs, (0, -vocab_size % _CDF_BLOCK))
    blocks = blocks.view(num_rows, -1, _CDF_BLOCK)  # [m, num_blocks, B]
    block_mass = blocks.sum(dim=-1).double()
    block_cdf = block_mass.cumsum(dim=-1)
    uniforms = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=probs.device)
                          for g in generators]).unsqueeze(1)  # [m, 1]
    target = uniforms * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_max(block_cdf.shape[1] - 1)
    mass_before = (block_cdf.gather(1, block) - block_mass.gather(1, block))
    inside = blocks[torch.arange(num_rows, device=probs.device), block.squeeze(1)]  # [m, B]
    inner_cdf = inside.double().cumsum(dim=-1)
    offset = torch.searchsorted(inner_cdf, (target - mass_before).clamp_min(0.0), right=True)
    # Rounding can put the target at or past the block's total: take its last kept token.
    last_kept = _CDF_BLOCK - 1 - (inside > 0).flip(-1).int().argmax(dim=-1, keepdim=True)
    offset = torch.where(offset >= _CDF_BLOCK, last_kept, offset)
    return (block * _CDF_BLOCK + offset).squeeze(1)


def _mask_top_k(scaled: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Keep each row's k highest logits (ties at the k-th value are all kept); 0 = off."""
    vocab_size = scaled.shape[-1]
    k_max = min(max(top_ks), vocab_size)
    ks = torch.tensor([min(k, vocab_size) or k_max for k in top_ks], device=scaled.device)
    kth = scaled.topk(k_max, dim=-1).values.gather(1, (ks - 1).unsqueeze(1))  # [m, 1]
    off = torch.tensor([k == 0 for k in top_ks], device=scaled.device).unsqueeze(1)
    kth = kth.masked_fill(off, -torch.inf)
    return scaled.masked_fill(scaled < kth, -torch.inf)


def _top_p_threshold(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Per row, the smallest probability kept by top-p ([m, 1]; 0 where top_p is off).

    Kept: the most likely tokens until their mass reaches top_p, the first always, and every
    token tied with the last kept one. A full sort of 50K tokens costs ~2 ms a row, so the
    cutoff is looked for among the top `_TOP_P_CANDIDATES` first, and only rows whose
    candidates hold less than top_p of the mass (flat distributions) are sorted whole.
    """
    on = torch.tensor([p < 1.0 for p in top_ps], device=probs.device).unsqueeze(1)
    ps = torch.tensor(top_ps, dtype=probs.dtype, device=probs.device).unsqueeze(1)
    ps = ps.masked_fill(~on, 0.0)  # off rows: trivially covered, threshold reset below
    candidates = probs.topk(min(_TOP_P_CANDIDATES, probs.shape[-1]), dim=-1).values
    threshold = _cutoff(candidates, ps)
    deep = (candidates.sum(dim=-1, keepdim=True) < ps).squeeze(1)
    if bool(deep.any()):
        threshold[deep] = _cutoff(probs[deep].sort(dim=-1, descending=True).values, ps[deep])
    return threshold.masked_fill(~on, 0.0)


def _cutoff(sorted_probs: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """The probability of the last token kept by top-p in each descending-sorted row."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # exactly 0 for the first token
    num_kept = (mass_before < ps).sum(dim=-1, keepdim=True).clamp_min(1)
    return sorted_probs.gather(1, num_kept - 1)


def _max_lse(logits: torch.Tensor) -> list[list[float]] | None:
    """Per row of fp32 logits [first argmax, max, logsumexp] from ext/ (one pass each), or
    None where there is no kernel or a row is not finite (NaN, +inf, all -inf): torch then
    takes those rows as it always did."""
    ext = kernels()
    if ext is None or logits.dtype is not torch.float32 or logits.dim() != 2 or not logits.is_contiguous():
        return None
    stats = ext.logits_max_lse(logits).tolist()
    return None if any(math.isnan(row[2]) for row in stats) else stats


def _score(logits: torch.Tensor, token_ids: torch.Tensor,
           num_top: list[int], stats: list[list[float]] | None) -> list[ScoredToken]:
    """Raw-logit log-probabilities of the chosen tokens and of each row's top alternatives
    (`stats`: _max_lse of these logits; None: torch's logsumexp)."""
    # logits: [m, V] raw; log_softmax(x)_t = x_t - logsumexp(x), without an [m, V] temporary
    if stats is not None:
        lse = torch.tensor([row[2] for row in stats], dtype=logits.dtype).unsqueeze(1)  # [m, 1]
    else:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [m, 1]
    chosen = (logits.gather(1, token_ids.unsqueeze(1)) - lse).squeeze(1).tolist()
    ids = token_ids.tolist()
    k_max = max(num_top, default=0)
    if k_max == 0:
        return [ScoredToken(t, lp) for t, lp in zip(ids, chosen)]
    values, top_ids = logits.topk(min(k_max, logits.shape[-1]), dim=-1)
    top_lps, top_ids_list = (values - lse).tolist(), top_ids.tolist()
    return [
        ScoredToken(t, lp, tuple(TokenLogprob(i, v) for i, v in zip(tid[:k], tlp[:k])))
        for t, lp, tid, tlp, k in zip(ids, chosen, top_ids_list, top_lps, num_top)
    ]
