"""Tandem decode_worker package."""
