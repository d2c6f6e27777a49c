"""Benchmarks: scripts that print a table and write JSON + PNG under bench/results/."""
