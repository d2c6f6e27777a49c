"""Tandem bench package."""
