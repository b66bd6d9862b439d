"""What a training step will cost before running one: trace (its ops on meta tensors), timing, memory, fit."""
