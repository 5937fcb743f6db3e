"""What one forward step is given (`ForwardBatch`) and the tensors built from it (`StepInputs`).

A step carries any mix of sequences: a whole prompt, one chunk of a long prompt (chunked
prefill), or one decode token. For each sequence the runner needs its new token ids, how
many of its tokens are already cached, one block table per KV group, and which of its new
rows to return logits for. Positions are implied: the new tokens sit at
num_computed_tokens, num_computed_tokens + 1, ...

Block tables map a sequence's logical block i (tokens i*block_size ... ) to a page id of
the pool. For a windowed group the runner reads only the blocks holding tokens inside the
window (plus the sink blocks in sink mode): entries of blocks that fell out of it may hold
any id, so the block manager can hand those pages to someone else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxwarden.plan.kv import KVLayout, cdiv


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's share of a step."""

    token_ids: tuple[int, ...]  # the new tokens of this step (>= 1)
    num_computed_tokens: int  # tokens of this sequence whose KV is already in the pool
    block_tables: tuple[tuple[int, ...], ...]  # one per KV group, logical block -> page id
    logits_rows: tuple[int, ...]  # indices into token_ids whose logits to return, ascending
    # The prompt's length when known (0: not given); tokens at positions past it were
    # generated. Length-dependent RoPE (dynamic NTK, LongRoPE) then rotates every prompt
    # token as one forward over the whole prompt would, however the prompt is chunked, and a
    # later token at position p with length p + 1 (as its decode step did); without it, each
    # token takes this step's context length. Attention that gives prompt rows another
    # precision than generated rows (ModelRunner.prompt_attention) reads the same boundary;
    # without it, a decode step's token counts as generated and other steps' as prompt.
    num_prompt_tokens: int = 0

    def __post_init__(self):
        if not self.token_ids:
            raise ValueError("a sequence in a forward batch needs at least one new token")
        if self.num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {self.num_computed_tokens}")
        n = len(self.token_ids)
        if any(not 0 <= r < n for r in self.logits_rows) or list(self.logits_rows) != sorted(set(self.logits_rows)):
            raise ValueError(f"logits_rows must be ascending distinct indices in [0, {n}), "
                             f"got {self.logits_rows}")

    @classmethod
    def chunk(cls, token_ids, num_computed_tokens: int, block_tables, logits: str = "last",
              num_prompt_tokens: int = 0) -> "SequenceInput":
        """Build one sequence's input; `logits` is 'last' (sampling), 'all' or 'none'."""
        n = len(token_ids)
        rows = {"last": (n - 1,), "all": tuple(range(n)), "none": ()}
        if logits not in rows:
            raise ValueError(f"logits must be 'last', 'all' or 'none', got {logits!r}")
        return cls(tuple(int(t) for t in token_ids), num_computed_tokens,
                   tuple(tuple(int(b) for b in bt) for bt in block_tables), rows[logits], num_prompt_tokens)

    @property
    def rope_lengths(self) -> list[int]:
        """Per new token, the sequence length its length-dependent RoPE is computed for."""
        if not self.num_prompt_tokens:
            return [self.context_tokens] * self.num_new_tokens
        p = self.num_prompt_tokens
        return [p if pos < p else pos + 1 for pos in self.positions]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_tokens(self) -> int:
        """Tokens of the sequence once this step has run."""
        return self.num_computed_tokens + len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.num_computed_tokens, self.context_tokens)


@dataclass(frozen=True)
class ForwardBatch:
    """Every sequence of one step, in the order their logits rows come back."""

    sequences: tuple[SequenceInput, ...]

    def __post_init__(self):
        if not self.sequences:
            raise ValueError("a forward batch needs at least one sequence")

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.sequences)

    @property
    def num_logits_rows(self) -> int:
        return sum(len(s.logits_rows) for s in self.sequences)

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token (the batched decode path)."""
        return all(s.num_new_tokens == 1 for s in self.sequences)


# ---------------------------------------------------------------------------------------
# Tensors built from a ForwardBatch, one set per step.


@dataclass(frozen=True)
class SequenceKeys:
    """Where one sequence's queries sit in the flat batch and which cached keys they read."""

    query_start: int
    query_end: int
    query_positions: torch.Tensor  # [n] absolute positions of the new tokens
    key_slots: torch.Tensor  # [m] flat slots (page * block_size + offset) to gather
    key_positions: torch.Tensor  # [m] absolute positions of those keys, ascending
    num_computed_tokens: int
    prompt_end: int = 0  # queries at positions < prompt_end are prompt tokens, later ones generated

    @property
    def num_prompt_rows(self) -> int:
        """How many of the new rows (a leading run) are prompt tokens."""
        n = self.query_end - self.query_start
        return min(n, max(0, self.prompt_end - self.num_computed_tokens))


@dataclass(frozen=True)
class DecodeKeys:
    """The same for an all-decode step, padded to one rectangle for a batched matmul."""

    key_slots: torch.Tensor  # [B, M] (padding points at slot 0 and is masked)
    key_positions: torch.Tensor  # [B, M]
    is_valid: torch.Tensor  # [B, M] bool
    query_positions: torch.Tensor  # [B]
    num_keys: torch.Tensor  # [B] valid keys of each row (a prefix of the row)
    num_sink_keys: torch.Tensor  # [B] leading keys that are sinks (scored against q_sink)


@dataclass(frozen=True)
class GroupInputs:
    """Per KV group: where new tokens are written and which keys each query reads."""

    slot_mapping: torch.Tensor  # [T] flat slot of each new token
    sequences: tuple[SequenceKeys, ...]
    decode: DecodeKeys | None
    sink_query_positions: torch.Tensor | None  # [T] position a query takes against sinks


@dataclass(frozen=True)
class StepInputs:
    """Flat tensors for one forward step."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    rope_seq_lens: torch.Tensor  # [T] length each token's sequence reaches in this step
    groups: tuple[GroupInputs, ...]
    logits_indices: torch.Tensor  # [R] rows of the flat batch to compute logits for


def build_step_inputs(batch: ForwardBatch, layout: KVLayout, num_blocks: int,
                      prompt_rows_apart: bool = False) -> StepInputs:
    """Turn a ForwardBatch into StepInputs, checking block tables against the layout.

    `prompt_rows_apart`: prompt rows take another attention precision than generated rows,
    so a step of single tokens takes the decode path (fp32, the generated rows' kernels)
    only when none of them is a prompt token (a prompt's last token after a prefix hit,
    or a one-token chunk, takes the prefill path).
    """
    for i, seq in enumerate(batch.sequences):
        _check_block_tables(i, seq, layout, num_blocks)
    ids, pos, lens, rows, start = [], [], [], [], 0
    for seq in batch.sequences:
        ids.extend(seq.token_ids)
        pos.extend(seq.positions)
        lens.extend(seq.rope_lengths)
        rows.extend(start + r for r in seq.logits_rows)
        start += seq.num_new_tokens
    groups = tuple(_group_inputs(batch, layout, g, prompt_rows_apart) for g in range(layout.num_groups))
    return StepInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
                      torch.tensor(lens, dtype=torch.long), groups,
                      torch.tensor(rows, dtype=torch.long))


def _check_block_tables(index: int, seq: SequenceInput, layout: KVLayout, num_blocks: int) -> None:
    if len(seq.block_tables) != layout.num_groups:
        raise ValueError(f"sequence {index} has {len(seq.block_tables)} block tables; the "
                         f"layout has {layout.num_groups} KV groups (one table per group)")
    need = cdiv(seq.context_tokens, layout.block_size)
    for g, table in enumerate(seq.block_tables):
        if len(table) < need:
            raise ValueError(f"sequence {index}, group {g}: {seq.context_tokens} tokens need "
                             f"{need} blocks of {layout.block_size}, the table has {len(table)}")
        bad = [b for b in table[:need] if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"sequence {index}, group {g}: block ids {bad[:4]} are outside "
                             f"the pool [0, {num_blocks})")


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return table[positions // block_size] * block_size + positions % block_size


def _key_positions(seq: SequenceInput, window: int | None, sinks: int) -> torch.Tensor:
    """Positions any new query of `seq` may read: the window of the first query, + sinks."""
    start = 0 if window is None else max(0, seq.num_computed_tokens - window + 1)
    window_keys = torch.arange(start, seq.context_tokens)
    if sinks and start > 0:
        return torch.cat((torch.arange(min(sinks, start)), window_keys))
    return window_keys


def _prompt_end(seq: SequenceInput, is_decode: bool) -> int:
    """Where `seq`'s generated tokens start: the prompt's length when given; else a decode
    step's token is generated and any other step's tokens are prompt."""
    if seq.num_prompt_tokens:
        return seq.num_prompt_tokens
    return seq.num_computed_tokens if is_decode else seq.context_tokens


def _group_inputs(batch: ForwardBatch, layout: KVLayout, g: int, prompt_rows_apart: bool = False) -> GroupInputs:
    window = layout.groups[g].window_tokens
    sinks = layout.sink_tokens if window else 0
    slot_parts, seqs, start, is_decode = [], [], 0, batch.is_decode
    for seq in batch.sequences:
        table = torch.tensor(seq.block_tables[g], dtype=torch.long)
        q_pos = torch.arange(seq.num_computed_tokens, seq.context_tokens)
        k_pos = _key_positions(seq, window, sinks)
        slot_parts.append(_slots(table, q_pos, layout.block_size))
        seqs.append(SequenceKeys(start, start + seq.num_new_tokens, q_pos,
                                 _slots(table, k_pos, layout.block_size), k_pos,
                                 seq.num_computed_tokens, _prompt_end(seq, is_decode)))
        start += seq.num_new_tokens
    if prompt_rows_apart and is_decode:
        is_decode = not any(s.num_prompt_rows for s in seqs)
    decode = _decode_keys(seqs, sinks) if is_decode else None
    sink_q = None
    if sinks:
        # StreamingLLM: positions are re-assigned inside the cache, so a query past the
        # sinks + window sees the sinks as if it sat at position sinks + window - 1.
        sink_q = torch.clamp(torch.cat([s.query_positions for s in seqs]), max=sinks + window - 1)
    return GroupInputs(torch.cat(slot_parts), tuple(seqs), decode, sink_q)


def _decode_keys(seqs: list[SequenceKeys], sinks: int) -> DecodeKeys:
    width = max(s.key_slots.shape[0] for s in seqs)
    slots = torch.zeros(len(seqs), width, dtype=torch.long)
    positions = torch.zeros(len(seqs), width, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, s in enumerate(seqs):
        m = s.key_slots.shape[0]
        slots[b, :m], positions[b, :m], valid[b, :m] = s.key_slots, s.key_positions, True
    q_pos = torch.cat([s.query_positions for s in seqs])
    num_keys = torch.tensor([s.key_slots.shape[0] for s in seqs], dtype=torch.long)
    num_sinks = ((positions < sinks) & valid).sum(1) if sinks else torch.zeros_like(num_keys)
    return DecodeKeys(slots, positions, valid, q_pos, num_keys, num_sinks)
