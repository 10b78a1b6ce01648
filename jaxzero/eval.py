"""`python -m jaxzero.eval`: the program lives in `jaxzero.cli.eval`."""

import sys

from jaxzero.cli.eval import main

if __name__ == "__main__":
    sys.exit(main())
