"""Checkpoints of other frameworks: read into (and written from) megalite's logical tensors (`source.Source`)."""
