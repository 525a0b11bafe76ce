"""trackio: local-first (no Hugging Face Space unless `TRACKIO_SPACE_ID` says so), its SQLite store under
`<trackers dir>/trackio/` (one `<project>.db`), one trackio run per experiment run. `trackio show --project
<project>` (with the same `TRACKIO_DIR`) opens its dashboard.

trackio reads its folder from `TRACKIO_DIR` once, when first imported: set here before that import unless the
environment already names one; a second server in the same process (tests) shares the first one's folder."""

from __future__ import annotations

import logging
import os
from typing import Any

from grpo_server.trackers.base import Point, Tracker

log = logging.getLogger(__name__)


class TrackioTracker(Tracker):
    name = "trackio"

    trackio_run: Any = None

    def open(self) -> None:
        os.environ.setdefault("TRACKIO_DIR", str(self.run.directory / "trackio"))
        import trackio

        self.trackio_run = trackio.init(project=self.run.project, name=self.run.experiment, config=self.run.config,
                                        embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def write(self, point: Point) -> None:
        self.trackio_run.log(dict(point.values), step=point.step)

    def close(self) -> None:
        if self.trackio_run is not None:
            self.trackio_run.finish()
