"""``python -m jaxzero.train ...``: the same as ``jaxzero train ...``."""

import sys

from jaxzero.train.loop import main

if __name__ == "__main__":
    sys.exit(main())
