"""Errors the CLI reports as one line: exit code 2 for bad usage or bad input, 1 for output that
could not be written."""


class InputError(ValueError):
    """Bad input from the user: a missing file, a non-GGUF model, a prompt too long, a bad option."""


class OutputError(Exception):
    """Output that could not be written (a full disk, a closed pipe): not the user's input, so
    the CLI exits with 1, after saving what was learned."""


class StoreError(InputError):
    """A store file that is corrupt, of an unknown schema, or of another model or machine."""


class StoreBusy(StoreError):
    """Another process holds the store's lock."""
