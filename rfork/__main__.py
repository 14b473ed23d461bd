"""`python -m rfork` is the same as the `rfork` command."""

import sys

from rfork.cli import main

sys.exit(main())
