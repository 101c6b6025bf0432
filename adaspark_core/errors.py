"""Errors the CLI reports as one line with exit code 2 (bad usage or bad input)."""


class InputError(ValueError):
    """Bad input from the user: a missing file, a non-GGUF model, a prompt too long, a bad option."""
