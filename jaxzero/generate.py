"""`python -m jaxzero.generate`: the program lives in `jaxzero.cli.generate`."""

import sys

from jaxzero.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
