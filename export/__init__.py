"""Checkpoint writers and readers."""
