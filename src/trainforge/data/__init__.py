"""Data: read rows, format and tokenize them, batch them. Imports nothing from the engine."""
