"""``python -m pearl_hpc.cli``."""

import sys

from pearl_hpc.cli.main import main

sys.exit(main())
