"""Tandem prefill_worker package."""
