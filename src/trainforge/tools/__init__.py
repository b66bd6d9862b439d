"""User-facing tools built on the engine's parts."""
