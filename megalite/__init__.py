"""megalite: readable, fast Megatron-style GPT pretraining."""

__version__ = "0.1.0"
