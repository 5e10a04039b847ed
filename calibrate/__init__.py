"""Runs data through a model: corpora, token batches, the architecture table, the layer walker."""
