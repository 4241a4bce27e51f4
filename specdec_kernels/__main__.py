"""`python -m specdec_kernels ...`: the same as the `specdec` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
