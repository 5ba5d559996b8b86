"""`python -m mmspec` runs the command line."""

import sys

from mmspec.cli import main

sys.exit(main())
