"""The master of a run: one loop around the controller (:mod:`.loop`), its executor for
engine workers (:mod:`.executor`), the step pipeline (:mod:`.steps`), the journal and
run directory (:mod:`.journal`) and what the run records (:mod:`.records`).

    backend ──capacity events──> queue ──> Controller.handle ──plan──> WorkerExecutor
    StepPipeline ──telemetry, Training Begin/Finished──┘                │
                                                            engines, router, weights
"""
