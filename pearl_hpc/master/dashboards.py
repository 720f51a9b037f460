"""The step metrics on the dashboards users already read (``dashboards:`` in the config).

Every recorded step's :class:`~pearl_hpc.master.records.StepMetrics` goes to
``metrics.jsonl`` (always) and, when configured, to

- TensorBoard: event files in ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``);
- Weights & Biases: a run in ``dashboards.wandb_project``; ``wandb_mode: offline`` needs
  no network (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later).

The keys are metrics.jsonl's, under ``pearl/`` (numbers; true/false as 1/0; the
per-worker ``roles`` map is left out), at the step's index. A restarted master appends to
the same places: W&B resumes the run by its id, TensorBoard adds an event file.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pearl_hpc.config.run import DashboardSettings
from pearl_hpc.master.records import StepMetrics
from pearl_hpc.rundir import RunDir

PREFIX = "pearl/"


def scalars(m: StepMetrics) -> dict[str, float]:
    """The step's numeric metrics under their metrics.jsonl names."""
    out: dict[str, float] = {}
    for key, value in asdict(m).items():
        if key == "step":
            continue
        if isinstance(value, int | float):  # true / false count as 1 / 0
            out[PREFIX + key] = float(value)
    return out


class Dashboards:
    """Writers opened at the first step, closed when the run ends."""

    def __init__(
        self, settings: DashboardSettings, run_dir: Path, run_name: str, config: dict[str, Any]
    ) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self.run_name = run_name
        self.config = config
        self._tb: Any = None
        self._wandb: Any = None

    @property
    def enabled(self) -> bool:
        return self.settings.tensorboard or bool(self.settings.wandb_project)

    def log(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        values = scalars(m)
        if self.settings.tensorboard:
            writer = self._tensorboard()
            for key, value in values.items():
                writer.add_scalar(key, value, global_step=m.step)
            writer.flush()
        if self.settings.wandb_project:
            self._wandb_run().log(values, step=m.step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            # finish() returns once the run's exit is acknowledged; its record file is
            # flushed when the W&B service closes the stream, which teardown waits for.
            wandb.teardown()
            self._wandb = None

    def _tensorboard(self) -> Any:
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(RunDir(self.run_dir).tensorboard))
        return self._tb

    def _wandb_run(self) -> Any:
        if self._wandb is None:
            import wandb

            self._wandb = wandb.init(
                project=self.settings.wandb_project,
                name=self.run_name,
                id=re.sub(r"[^A-Za-z0-9_-]", "-", self.run_dir.name)[:64],
                resume="allow",
                dir=str(RunDir(self.run_dir).wandb.parent),  # it makes wandb/ there
                mode=self.settings.wandb_mode,  # type: ignore[arg-type]  # checked: WANDB_MODES
                config=self.config,
                settings=wandb.Settings(silent=True, console="off"),
            )
        return self._wandb
