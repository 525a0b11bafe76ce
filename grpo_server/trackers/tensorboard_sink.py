"""TensorBoard: event files under `<trackers dir>/tensorboard/<experiment>/<start time>/`, one folder per run (a
server start or an experiment's new life), so `tensorboard --logdir <trackers dir>/tensorboard` shows each
experiment's runs side by side."""

from __future__ import annotations

import time
from typing import Any

from grpo_server.trackers.base import Point, Tracker

FLUSH_SECS = 10  # SummaryWriter's default is 120 s: a live dashboard would lag two minutes behind the log


class TensorboardTracker(Tracker):
    name = "tensorboard"

    writer: Any = None

    def open(self) -> None:
        # torch's SummaryWriter, not a hand-made event file: it writes tensorboard's own protos (the `tensorboard`
        # package must be installed), and torch is already the server's.
        from torch.utils.tensorboard import SummaryWriter

        folder = self.run.directory / "tensorboard" / self.run.experiment / time.strftime("%Y%m%d-%H%M%S")
        self.writer = SummaryWriter(log_dir=str(folder), flush_secs=FLUSH_SECS)
        self.writer.add_text("config", _as_markdown(self.run.config), global_step=0)

    def write(self, point: Point) -> None:
        for key, value in point.values.items():
            self.writer.add_scalar(key, value, global_step=point.step, walltime=point.time)

    def close(self) -> None:
        self.writer.close()


def _as_markdown(config: dict[str, Any]) -> str:
    import json

    return "```\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```"
