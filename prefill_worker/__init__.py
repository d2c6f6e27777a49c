"""The prefill worker actor: computes a request's KV and first token and serves the KV to a decode worker under a lease."""
