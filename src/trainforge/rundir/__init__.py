"""The run directory: its lock, atomic writes, checkpoints on disk, and write errors that name the path."""
