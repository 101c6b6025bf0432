"""What persists: the learned store (atomic, locked, fingerprinted), the round record and its
JSON-lines log, and the n-gram memory's file. Imports base, engine and candidates only."""
