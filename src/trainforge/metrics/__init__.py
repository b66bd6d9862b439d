"""Metrics: the metrics.jsonl log and the live console. Imports nothing of ours but config."""
