"""The contracts between Tandem's actors: what the coordinator, the router and the workers send
each other, the typed interfaces each actor serves, and the fault vocabulary. Every package
above ``engine`` imports these; they import only the engine's value types.

(Named ``contracts``, not ``proto``: the environment's ``proto-plus`` owns the top-level name
``proto``; ``proto/`` keeps the gRPC schema.)"""
