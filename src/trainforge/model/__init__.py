"""Models and tokenizers: load, build from scratch, adapt with PEFT. Imports nothing from data or engine."""
