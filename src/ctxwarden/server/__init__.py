"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

app.py (routes, readiness, draining), protocol.py (request/response models), errors.py
(OpenAI error objects), tenants.py (API keys -> tenant -> prefix-cache namespace),
metrics.py (Prometheus), async_engine.py (the engine on its own thread), generation.py
(one request's choices), responses.py (wire format). Importing this package loads no model.
"""
