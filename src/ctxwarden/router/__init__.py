"""`ctxwarden route`: an OpenAI-compatible front over several replicas.

- `affinity`: the prefix key of a request (a salted hash chain over its first blocks) and
  the choice of replica: rendezvous hashing, bounded by load (no torch, no I/O).
- `app`: the FastAPI proxy (httpx), health checks, router metrics.

Routing is advisory: it only makes a warm replica likely. Every replica verifies every
block it fetches from a shared tier, so a wrong route costs time, never correctness.
"""
