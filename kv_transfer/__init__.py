"""Tandem kv_transfer package."""
