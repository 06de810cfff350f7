"""`python -m kiln.tasks.cli`: the `kiln` command line without the console script on PATH."""

import sys

from kiln.tasks.cli.main import main

sys.exit(main())
