"""The engine: the run lifecycle (setup -> steps -> finish), one training step, its state and checkpoints; predict/ prices a step before running one."""
