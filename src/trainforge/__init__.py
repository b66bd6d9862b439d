"""trainforge: train and fine-tune language models as fast as the hardware allows, and prove it."""

import time as _time

__version__ = "0.1.0"

IMPORTED_AT = _time.perf_counter()  # the first run of a process counts the imports after this as its start-up
