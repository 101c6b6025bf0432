"""The ground floor: errors, paths, file rules (atomic writes, bounded reads), schema upgrades,
range checks, the candidate tree and the seeded draws. Imports nothing else of adaspark_core."""
