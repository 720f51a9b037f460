"""``python -m pearl_hpc.worker``: a process of an MPI world (see :mod:`.main`)."""

import sys

from pearl_hpc.worker.main import main

sys.exit(main())
