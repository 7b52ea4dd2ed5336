"""Scheduling layer: pure Python, no torch (docs/architecture.md)."""
