"""trainforge: train and fine-tune language models as fast as the hardware allows, and prove it."""

__version__ = "0.1.0"
