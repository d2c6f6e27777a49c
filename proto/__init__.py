"""Tandem proto package."""
