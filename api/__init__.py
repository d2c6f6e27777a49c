"""The OpenAI-compatible HTTP edge of the cluster. The wire schema (``protocol``); a body's
translation into choices for the cluster (``translate``); the choices' run on the cluster
(``choices``); response objects and SSE (``responses``); the request path (``app``: its
``Service`` is what ``tandem.deployment``, the Ray Serve app, delegates to); health, cluster
view and metrics scrape (``operator_plane``); the ingress gate (``gate``: body size, API keys,
tenant quotas); Prometheus metrics (``metrics``); the FastAPI app's edges (``edge``)."""
