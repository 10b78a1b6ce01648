"""`python -m jaxzero.prepare`: the program lives in `jaxzero.cli.prepare`."""

import sys

from jaxzero.cli.prepare import main

if __name__ == "__main__":
    sys.exit(main())
