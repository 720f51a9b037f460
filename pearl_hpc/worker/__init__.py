"""What a member of the run's MPI world does: trainer ranks (:mod:`.trainer`), engine
ranks (:mod:`.engine`), and where each runs (:mod:`.placement`). Their entry is
:mod:`pearl_hpc.rank`."""
