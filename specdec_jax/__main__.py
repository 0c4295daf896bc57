"""`python -m specdec_jax {generate,bench} ...` (see specdec_jax/cli.py)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
