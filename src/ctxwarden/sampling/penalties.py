"""Repetition, presence and frequency penalties: the logit edits made before sampling.

Formulas (for a token t with logit l):
- repetition (Hugging Face / CTRL): if t occurs in prompt or output so far,
  l -> l / r when l > 0, and l -> l * r when l <= 0 (r > 1 discourages repeats).
- frequency and presence (OpenAI): over output tokens only,
  l -> l - frequency_penalty * count(t) - presence_penalty * [count(t) > 0].

Repetition is applied first, then frequency/presence, as vLLM does.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ctxwarden.sampling.params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams,
                    prompt_token_ids: Sequence[int],
                    output_token_ids: Sequence[int]) -> torch.Tensor:
    """Return a penalised copy of one row of logits ([vocab], any float dtype).

    Tokens ids outside [0, vocab) are an error (they would mean the caller mixed up
    vocabularies). The input tensor is never modified.
    """
    # logits: [V]
    out = logits.clone()
    vocab_size = logits.shape[-1]
    device = logits.device
    output_ids = torch.as_tensor(list(output_token_ids), dtype=torch.long, device=device)
    _check_ids(output_ids, vocab_size, "output_token_ids")
    if params.repetition_penalty != 1.0:
        prompt_ids = torch.as_tensor(list(prompt_token_ids), dtype=torch.long, device=device)
        _check_ids(prompt_ids, vocab_size, "prompt_token_ids")
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        seen[prompt_ids] = True
        seen[output_ids] = True
        r = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        counts = torch.bincount(output_ids, minlength=vocab_size).to(out.dtype)
        out -= params.frequency_penalty * counts
        out -= params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def _check_ids(ids: torch.Tensor, vocab_size: int, name: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"{name} holds ids outside [0, {vocab_size}) (min {int(ids.min())}, max "
            f"{int(ids.max())}): the logits and the token ids come from different vocabularies."
        )
