"""What one layer's attention computes beyond q, k and v: its variant (window, sinks, soft-cap, scale), the
reference math every backend and every context-parallel mode is held to, and the one dispatch the model calls."""
