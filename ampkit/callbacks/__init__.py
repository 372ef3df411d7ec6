"""Callbacks: one concern each."""
