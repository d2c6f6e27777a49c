"""Tandem engine package."""
