"""Scheduling layer: pure Python, no torch (see DESIGN.md section 1)."""
