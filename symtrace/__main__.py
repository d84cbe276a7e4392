"""``python -m symtrace``: the command line (see :mod:`symtrace.cli`)."""
from symtrace.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
