"""Quantization algorithms: one file per algorithm, each a frozen config, a pure core, an apply()."""
