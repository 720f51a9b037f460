"""What a process of the run's MPI world does: the rank entry (:mod:`.main`; rank 0 is
the master, ``join`` an elastic job's engine rank), trainer ranks (:mod:`.trainer`) and
engine ranks (:mod:`.engine`)."""
