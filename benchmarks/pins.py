"""Print ``name==version`` for each installed distribution named on the command line (run it with the
interpreter whose versions you want), so another environment can install exactly those."""

import importlib.metadata as md
import sys

print(" ".join(f"{name}=={md.version(name)}" for name in sys.argv[1:]))
