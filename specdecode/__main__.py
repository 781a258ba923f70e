"""`python -m specdecode ...` == `specdecode ...`."""

import sys

from specdecode.cli import main

sys.exit(main())
