"""`python -m jaxzero.launch`: the program lives in `jaxzero.cli.launch`."""

import sys

from jaxzero.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
