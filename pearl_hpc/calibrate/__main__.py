"""``python -m pearl_hpc.calibrate``: one gloo rank."""

import sys

from pearl_hpc.calibrate.gloo import _rank_main

sys.exit(_rank_main())
