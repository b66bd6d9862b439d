"""The engine: one training step, the schedule, evaluation, and the trainer that wires everything."""
