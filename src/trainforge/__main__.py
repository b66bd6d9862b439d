"""`python -m trainforge`: the command line (cli.py)."""

from .cli import main

main()
