"""Tandem cluster package."""
