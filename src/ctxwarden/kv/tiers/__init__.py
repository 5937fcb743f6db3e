"""KV tiers: host RAM, one local directory, Redis (pure Python over bytes, no torch).

- `config`: TierSpec / TiersConfig, parsed from `ram:4GiB,disk:/path:20GiB,redis://host:6379`.
- `keys`: the namespace (model, tokenizer, dtypes, layout, RoPE) and the key strings.
- `value`: self-verifying objects and manifests (headers, checksums, Merkle root).
- `stores`: RamStore, DiskStore, RedisStore: get / exists / put-if-absent / delete on bytes.
- `breaker`, `writer`: the circuit breaker and the asynchronous, droppable store queue.
- `cost`: fetch or recompute, from measured prefill rate and tier latency / bandwidth.
- `client`: KVTiers, what the scheduler and the engine call (lookup, fetch, spill, store).

Moving pages between the torch pool and bytes is the engine's job (ctxwarden.engine.tiers);
deciding what to fetch is the scheduler's (ctxwarden.scheduler.tiering). See docs/kv-tiers.md.
"""

from ctxwarden.kv.tiers.client import FetchResult, KVTiers, SpilledPage, StoreJob, TierRun
from ctxwarden.kv.tiers.config import TierSpec, TiersConfig, parse_tiers
from ctxwarden.kv.tiers.cost import CostModel, Decision
from ctxwarden.kv.tiers.keys import TierNamespace, fingerprint_files
from ctxwarden.kv.tiers.stats import TierStats
from ctxwarden.kv.tiers.value import Expected, IntegrityError, PageFormat

__all__ = ["CostModel", "Decision", "Expected", "FetchResult", "IntegrityError", "KVTiers", "PageFormat",
           "SpilledPage", "StoreJob", "TierNamespace", "TierRun", "TierSpec", "TierStats", "TiersConfig",
           "fingerprint_files", "parse_tiers"]
