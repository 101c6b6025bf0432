"""AdaSpark: speculative decoding with tree verification, scheduled by online-learned models."""

__version__ = "0.1.0"
