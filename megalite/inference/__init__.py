"""Inference: KV-cached generation and sampling, and loading a saved model (any layout) into one process."""
