"""The decode worker actor: reserves blocks, pulls a request's KV from its prefill worker, then decodes it in its continuous batch."""
