"""`python -m jaxzero.plan`: the program lives in `jaxzero.cli.plan`."""

import sys

from jaxzero.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
