"""MLflow: one MLflow run per experiment run (a server start or an experiment's new life), in the MLflow
experiment named by `trackers.project`. The store is `trackers.mlflow_tracking_uri`, by default a SQLite file
in the trackers folder (`sqlite:///<run_dir>/trackers/mlflow.db`): MLflow 3 refuses its old file store unless
told to, and a database is what it recommends. Read it with `mlflow ui --backend-store-uri <that uri>`, or
`MlflowClient(<that uri>).get_metric_history(run_id, "train/reward_mean")`."""

from __future__ import annotations

import json
import time
from typing import Any

from grpo_server.trackers.base import Point, Tracker

MAX_PARAM_CHARS = 6000  # MLflow's limit on a parameter's value


def tracking_uri(run: Any) -> str:
    configured = getattr(run.options, "mlflow_tracking_uri", None)
    return configured or f"sqlite:///{(run.directory / 'mlflow.db').resolve()}"


class MlflowTracker(Tracker):
    name = "mlflow"

    client: Any = None
    run_id: str | None = None

    def open(self) -> None:
        from mlflow.tracking import MlflowClient

        self.run.directory.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=tracking_uri(self.run))
        experiment_id = self._experiment_id()
        created = self.client.create_run(experiment_id, run_name=self.run.experiment,
                                         tags={"grpo_server.experiment": self.run.experiment})
        self.run_id = created.info.run_id
        from mlflow.entities import Param

        params = [Param(key, value[:MAX_PARAM_CHARS]) for key, value in _flatten(self.run.config).items()]
        self.client.log_batch(self.run_id, params=params)

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.run.project)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(self.run.project)
        except Exception:  # another experiment's tracker created it first (same store, another thread)
            found = self.client.get_experiment_by_name(self.run.project)
            if found is None:
                raise
            return found.experiment_id

    def write(self, point: Point) -> None:
        from mlflow.entities import Metric

        millis = int(point.time * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, millis, point.step)
                                                    for key, value in point.values.items()])

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, end_time=int(time.time() * 1000))


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{lora: {r: 16}}` -> `{"lora.r": "16"}`: MLflow parameters are flat strings."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return flat
