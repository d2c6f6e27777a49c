"""KV block transfer between prefill and decode workers.

``format`` defines what a transfer carries and how it is checked; ``exporter`` is the sending
side (leases, layer readiness, fault injection); ``grpc_transport`` serves exports and pulls over
gRPC; ``torch_transport`` pulls payloads over torch.distributed pair groups under the same gRPC
control stream; ``transport`` is the interface both clients implement.

Nothing is imported here: the ingress reads ``kv_transfer.errors`` without loading the
transports (and torch).
"""
