"""A peer trainer (speculators) next to ours: the same rows for both, one evaluate (README.md here)."""
