"""Checkpoint formats behind one interface (base.ExportFormat), listed in registry.FORMATS."""
