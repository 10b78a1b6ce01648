"""`python -m jaxzero.export`: the program lives in `jaxzero.cli.export`."""

import sys

from jaxzero.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
