"""Machine facts: the device and its dtypes, hardware profiles, CPU threads, the allocator's settings. Kept light: hardware/allocator.py must import without torch."""
