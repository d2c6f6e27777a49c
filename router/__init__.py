"""Tandem router package."""
