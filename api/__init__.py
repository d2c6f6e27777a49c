"""The OpenAI-compatible HTTP API on Ray Serve: request/response schema (``protocol``), the
ingress gate (``gate``: body size, API keys, tenant quotas), Prometheus metrics (``metrics``),
the FastAPI app (``app``) and its Serve deployment (``deployment``)."""
