"""The pure controller core: no subprocess, MPI, network or wall clock in here.

Data flow (one writer: the :class:`~pearl_hpc.core.controller.Controller`)::

    events ──> Controller.handle ──> RuntimeTracker (profile refit)
                     │                     │
                     ├──> budget (table + free capacity + borrowing policy)
                     │                     │
                     ├──> PD policy / DecisionEngine(profile, N_k, incumbent) ──> PDConfig
                     ├──> plan_transition(table, target, capacity) ──> TransitionPlan
                     └──> RoleTable updates + Executor calls (simulator | local | Slurm)
"""
