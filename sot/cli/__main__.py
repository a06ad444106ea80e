"""``python -m sot.cli``."""
import sys

from sot.cli import main

sys.exit(main())
