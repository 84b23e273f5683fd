"""Attention backends: one class per implementation, chosen once per engine (selector.py)."""
