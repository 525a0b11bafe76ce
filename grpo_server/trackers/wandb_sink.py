"""Weights & Biases: one run per experiment run, offline by default (`trackers.wandb_mode`), written under
`<trackers dir>/wandb/` (`wandb sync` uploads it later, from a machine that may reach the service). The
environment's `WANDB_MODE=offline` (or `disabled`) always wins over the config: a deployment that says offline
never reaches the network.

Every series is plotted against `learner_step` (wandb's define_metric), not wandb's own `_step`: a push is
recorded when its check ends, after later train steps may have been, and wandb drops a point whose `step=` is
below one already logged."""

from __future__ import annotations

import os
from typing import Any

from grpo_server.trackers.base import Point, Tracker

STEP_METRIC = "learner_step"


def wandb_mode(configured: str) -> str:
    from_env = os.environ.get("WANDB_MODE", "").strip().lower()
    return from_env if from_env in ("offline", "disabled") else configured


class WandbTracker(Tracker):
    name = "wandb"

    wandb_run: Any = None

    def open(self) -> None:
        import wandb

        folder = self.run.directory  # wandb makes its own `wandb/` folder inside
        folder.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, save_code=False, disable_git=True,
                                  x_disable_stats=True)  # no system metrics thread, no stdout capture
        mode = wandb_mode(getattr(self.run.options, "wandb_mode", "offline"))
        self.wandb_run = wandb.init(project=self.run.project, name=self.run.experiment, config=self.run.config,
                                    dir=str(folder), mode=mode,
                                    reinit="create_new",  # several experiments' runs open in one process
                                    settings=settings)
        self.wandb_run.define_metric(STEP_METRIC)
        self.wandb_run.define_metric("*", step_metric=STEP_METRIC)

    def write(self, point: Point) -> None:
        self.wandb_run.log({**point.values, STEP_METRIC: point.step})

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
