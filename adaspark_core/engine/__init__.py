"""Targets and drafters: the only code that runs a model."""
