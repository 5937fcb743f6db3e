"""Who holds KV blocks right now: every sequence of the KV manager, with its request's state.

The engine thread reads this between steps (ctxwarden.server.owners turns it into owner
records with tenants, ages and risk). A sequence whose request the engine no longer knows
is reported as `unknown`; blocks in use that no sequence names are counted as orphans.
Cost: O(held blocks) plus one pass over the pool's ref counts.
"""

from __future__ import annotations

from dataclasses import dataclass

UNKNOWN_STATE = "unknown"  # the KV manager holds the sequence, the engine forgot the request


@dataclass(frozen=True)
class KVHolder:
    """The blocks one sequence holds and the state of its request (a RequestStatus value)."""

    seq_id: str
    num_blocks: int
    state: str  # running | waiting | swapped | finished | unknown


@dataclass(frozen=True)
class KVHolders:
    """Every holder, the blocks in use that nobody holds, and the host swap bytes."""

    holders: tuple[KVHolder, ...]
    num_orphan_blocks: int
    host_swap_bytes: int


def kv_holders(engine) -> KVHolders:
    """The engine's KV holders now (call between steps, on the engine's own thread)."""
    kv = engine.scheduler.kv
    held: set[int] = set()
    out = []
    for seq in kv.sequences():
        ids = seq.held_block_ids()
        held.update(ids)
        req = engine.requests.get(seq.seq_id)
        out.append(KVHolder(str(seq.seq_id), len(ids), req.status.value if req is not None else UNKNOWN_STATE))
    refs = kv.pool.ref_counts()
    num_in_use = len(refs) - refs.count(0)
    return KVHolders(tuple(out), num_in_use - len(held), int(engine.scheduler.swapped_bytes))
