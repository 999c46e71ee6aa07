"""``python -m flashtile <command>``: see ``flashtile.cli``."""

import sys

from flashtile.cli import main

if __name__ == "__main__":
    sys.exit(main())
