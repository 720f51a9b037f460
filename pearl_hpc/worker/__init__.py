"""What a process of the run's MPI world does: the rank entry (:mod:`.main`; rank 0 is
the master), trainer ranks (:mod:`.trainer`), engine ranks (:mod:`.engine`), and the
no-op member of ``pearl-hpc launch`` (:mod:`.noop`, the plane's test fake)."""
