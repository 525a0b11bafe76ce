"""Experiment trackers: the metrics log's records, also sent to trackio, Weights & Biases, MLflow or TensorBoard.

`grpo_server/trackers/base.py` has the sink interface (`Tracker`) and the buffered dispatcher (`TrackerSet`);
each backend is one module here, imported only when an experiment asks for it, so the server runs without the
`trackers` extra. Which trackers an experiment gets: its config's `trackers`, or the server's
`trackers.default` (grpo_server/config.py).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_server.trackers.base import BufferedSink, Point, SinkCounts, Tracker, TrackerRun, TrackerSet

if TYPE_CHECKING:
    from grpo_server.config import TrackersSettings

__all__ = ["BufferedSink", "Point", "SinkCounts", "Tracker", "TrackerRun", "TrackerSet", "TRACKERS",
           "default_trackers", "missing_libraries", "open_trackers"]

# name -> (module of its Tracker, class, the libraries it imports): modules are imported when used.
TRACKERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "trackio": ("grpo_server.trackers.trackio_sink", "TrackioTracker", ("trackio",)),
    "wandb": ("grpo_server.trackers.wandb_sink", "WandbTracker", ("wandb",)),
    "mlflow": ("grpo_server.trackers.mlflow_sink", "MlflowTracker", ("mlflow", "sqlalchemy")),
    # torch's SummaryWriter writes tensorboard's event files with tensorboard's own protos.
    "tensorboard": ("grpo_server.trackers.tensorboard_sink", "TensorboardTracker", ("tensorboard", "torch")),
}


def missing_libraries(names: list[str]) -> dict[str, list[str]]:
    """The trackers among `names` whose libraries are not installed -> those libraries (found without importing
    them: checking a config must not load wandb or torch into the front end)."""
    missing = {}
    for name in names:
        absent = [lib for lib in TRACKERS[name][2] if importlib.util.find_spec(lib) is None]
        if absent:
            missing[name] = absent
    return missing


def default_trackers(settings: "TrackersSettings") -> list[str]:
    """The server's `trackers.default`; unset, trackio (local, offline) where its library is installed, as TRL's
    docs recommend it, and the metrics log alone elsewhere."""
    if settings.default is not None:
        return list(settings.default)
    return [] if missing_libraries(["trackio"]) else ["trackio"]


def tracker_class(name: str) -> type[Tracker]:
    module, cls, _ = TRACKERS[name]
    return getattr(importlib.import_module(module), cls)


def open_trackers(names: list[str], experiment: str, config: dict[str, Any], settings: "TrackersSettings",
                  run_dir: Path, step: int = 0) -> TrackerSet:
    """An experiment's TrackerSet, one buffered sink per name. Each opens its run on its own thread, with its
    first record: creating an experiment never waits for a backend."""
    run = TrackerRun(experiment=experiment, directory=settings.directory or run_dir / "trackers",
                     project=settings.project, config=config, options=settings)
    sinks = {name: BufferedSink(tracker_class(name)(run), settings.buffer_records) for name in names}
    return TrackerSet(sinks=sinks, step=step)
