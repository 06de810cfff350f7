"""Kiln package."""
