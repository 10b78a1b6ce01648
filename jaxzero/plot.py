"""`python -m jaxzero.plot`: the program lives in `jaxzero.cli.plot`."""

import sys

from jaxzero.cli.plot import main

if __name__ == "__main__":
    sys.exit(main())
