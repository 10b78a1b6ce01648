"""`python -m jaxzero.train`: the program lives in `jaxzero.cli.train`."""

import sys

from jaxzero.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
