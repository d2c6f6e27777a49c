"""Tandem router: which prefill and decode replicas serve a request.

``prefix_index`` keeps an exact per-worker index of cached block hashes from the workers' KV
events; ``policy.choose`` scores the replicas (load, uncached prompt tokens, KV use, failure
domains) and returns a ``Decision`` with every candidate's terms. Both are free of Ray so they
are unit-tested and benchmarked directly; the actor wraps them.
"""
