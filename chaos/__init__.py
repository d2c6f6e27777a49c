"""``tandem chaos``, the fault-injection harness (above ``tandem`` in the stack, below
``bench``): fault plans run against a live Tandem under real load, every promise of
docs/design.md#promises checked from outside (the client's tokens against a reference engine)
and inside (pools, leases, terminal records, the router's health log), and a report. Its load
generator and endpoint probes serve the benchmarks and the e2e tests too."""
