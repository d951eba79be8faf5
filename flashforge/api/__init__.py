"""Public API layer: validation and the user-facing functions."""
