"""Experiment trackers (grpo_server/trackers/): real metrics-log records through the buffered dispatcher into each
backend's library, offline, and read back with that library's own reader; a tracker that raises or hangs never
holds up the feeder; a tracker whose library is missing is a config error; and one experiment on the real test
server whose train and push series reach the stores."""

from __future__ import annotations

import glob
import json
import sqlite3
import struct
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from grpo_server.api_models import VerificationResult
from grpo_server.config import ExperimentConfig, ServerConfig, TrackersSettings
from grpo_server.protocol.errors import Unprocessable
from grpo_server.protocol.wire import TrainMetrics
from grpo_server.runtime.metrics_log import MetricsLog
from grpo_server.trackers import BufferedSink, Point, Tracker, TrackerRun, TrackerSet, missing_libraries, open_trackers
from grpo_server.trackers import TRACKERS
from grpo_server.trackers.base import point_of

STEPS = 3


def train_metrics(step: int) -> TrainMetrics:
    return TrainMetrics(step=step, loss=0.1 * step, reward_mean=0.25 * step, reward_std=0.5, kl=0.01 * step,
                        clipped_fraction=0.05, ratio_mean=1.0, ratio_std=0.01, ratio_min=0.9, ratio_max=1.1,
                        grad_norm=2.0, tokens=64, seconds=1.5, checked_version=step - 1, sampler_gap_tokens=10,
                        sampler_gap_mean=1e-6 * step, sampler_gap_max=1e-5, mismatch_kl=1e-7 * step,
                        mismatch_kl_fresh=2e-7, offpolicy_kl_stale=0.003)


def write_run(log: MetricsLog) -> None:
    """What an experiment's metrics log writes over STEPS steps: a train line per step, a push per version (its
    check: ok, then failed, then inconclusive), and a sampling line. The push of step 2 is written after the
    train line of step 3, as a slow check makes it."""
    from grpo_server.api_models import ExperimentCounters

    log.sampling(ExperimentCounters(groups_sampled=2, completions_sampled=8, tokens_sampled=40))
    verdicts = {1: True, 2: False, 3: None}
    for step in range(1, STEPS + 1):
        log.train(train_metrics(step), policy_version=step - 1, groups=2)
        if step >= 2:
            check = VerificationResult(version=step - 1, mean_abs_diff=0.001 * (step - 1), max_abs_diff=0.01,
                                       tokens=12, ok=verdicts[step - 1], checked_on="trained_batch")
            log.push(step - 1, step - 1, push_seconds=0.5 + step, verification=check)
    log.push(STEPS, STEPS, push_seconds=9.0, verification=VerificationResult(
        version=STEPS, mean_abs_diff=0.003, max_abs_diff=0.01, tokens=12, ok=verdicts[STEPS]))


def feed_backend(name: str, tmp_path: Path, **options) -> TrackerSet:
    settings = TrackersSettings(directory=tmp_path / "trackers", project=f"test-{name}", **options)
    trackers = open_trackers([name], "exp-a", {"name": "exp-a", "lora": {"r": 8}}, settings, tmp_path)
    log = MetricsLog(tmp_path / "metrics" / "exp-a.jsonl", feed=trackers.feed)
    write_run(log)
    log.close()
    trackers.close(timeout_s=120)
    counts = trackers.counts()[name]
    assert (counts.errors, counts.dropped, counts.last_error) == (0, 0, None)
    assert counts.written == 1 + STEPS + STEPS  # every record: sampling, trains, pushes
    return trackers


def check_series(series: dict[str, dict[int, float]]) -> None:
    """The series every backend must hold, by name -> {learner step: value}."""
    assert series["train/reward_mean"] == {1: 0.25, 2: 0.5, 3: 0.75}
    assert series["train/kl"] == pytest.approx({1: 0.01, 2: 0.02, 3: 0.03})
    assert series["train/clipped_fraction"] == pytest.approx({1: 0.05, 2: 0.05, 3: 0.05})
    assert series["train/sampler_gap_mean"] == pytest.approx({1: 1e-6, 2: 2e-6, 3: 3e-6})
    assert series["train/mismatch_kl"] == pytest.approx({1: 1e-7, 2: 2e-7, 3: 3e-7})
    assert series["train/mismatch_kl_fresh"] == pytest.approx({1: 2e-7, 2: 2e-7, 3: 2e-7})
    assert series["train/offpolicy_kl_stale"] == pytest.approx({1: 0.003, 2: 0.003, 3: 0.003})
    assert series["push/push_seconds"] == {1: 2.5, 2: 3.5, 3: 9.0}  # on each push's own step
    assert series["push/verified"] == {1: 1.0, 2: 0.0}  # inconclusive: no value
    assert series["push/inconclusive"] == {1: 0.0, 2: 0.0, 3: 1.0}
    assert series["push/mean_abs_diff"] == pytest.approx({1: 0.001, 2: 0.002, 3: 0.003})
    assert series["sampling/tokens_per_s"].keys() == {0}  # before the first step


# --- the dispatcher alone ------------------------------------------------------------------------


def test_record_becomes_numbers_on_the_learner_step():
    point = point_of({"time": 5.0, "kind": "push", "step": 7, "version": 3, "verified": False, "verdict": "failed",
                      "mean_abs_diff": 0.2, "checked_on": "probe", "step_fraction": None}, step=7)
    assert point == Point(kind="push", step=7, time=5.0, values={
        "push/version": 3.0, "push/verified": 0.0, "push/mean_abs_diff": 0.2, "push/inconclusive": 0.0})

    seen: list[Point] = []
    trackers = TrackerSet(sinks={"list": BufferedSink(ListTracker(seen), 100)}, step=4)
    trackers.feed({"time": 1.0, "kind": "sampling", "tokens_per_s": 3.0})  # before any train line: the resumed step
    trackers.feed({"time": 2.0, "kind": "train", "step": 5, "reward_mean": 0.5})
    trackers.feed({"time": 3.0, "kind": "push", "step": 4, "version": 2, "push_seconds": 1.0})  # its own step
    trackers.feed({"time": 4.0, "kind": "sampling", "tokens_per_s": 6.0})
    trackers.close(5)
    assert [(p.kind, p.step) for p in seen] == [("sampling", 4), ("train", 5), ("push", 4), ("sampling", 5)]
    assert trackers.counts()["list"].written == 4


class ListTracker(Tracker):
    name = "list"

    def __init__(self, into: list, run: TrackerRun | None = None):
        super().__init__(run or TrackerRun("exp", Path("."), "p", {}))
        self.into = into
        self.closed = False

    def open(self) -> None:
        pass

    def write(self, point: Point) -> None:
        self.into.append(point)

    def close(self) -> None:
        self.closed = True


class RaisingTracker(ListTracker):
    name = "raising"

    def write(self, point: Point) -> None:
        raise ConnectionError(f"backend down at step {point.step}")


class BlockingTracker(ListTracker):
    name = "blocking"

    def __init__(self, into: list, release: threading.Event):
        super().__init__(into)
        self.release = release

    def write(self, point: Point) -> None:
        self.release.wait()  # a backend that hangs until told otherwise
        super().write(point)


def test_a_failing_or_hung_tracker_never_stalls_the_feeder(tmp_path):
    good, hung, release = [], [], threading.Event()
    sinks = {"good": BufferedSink(ListTracker(good), 1000), "raising": BufferedSink(RaisingTracker([]), 1000),
             "blocking": BufferedSink(BlockingTracker(hung, release), 5)}
    trackers = TrackerSet(sinks=sinks)
    log = MetricsLog(tmp_path / "m.jsonl", feed=trackers.feed)
    records = 200
    started = time.monotonic()
    for step in range(records):
        log.train(train_metrics(step), policy_version=step, groups=1)
    assert time.monotonic() - started < 2.0  # 200 lines written and fed while one tracker hangs
    assert len(log.records("train")) == records  # the metrics log, the source of truth, has every one

    deadline = time.monotonic() + 10
    while sinks["good"].counts.written + sinks["raising"].counts.errors < 2 * records and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [p.step for p in good] == list(range(records))
    raising = sinks["raising"].counts
    assert (raising.written, raising.errors) == (0, records)
    assert raising.last_error == f"write: ConnectionError: backend down at step {records - 1}"
    blocking = sinks["blocking"].counts
    # One record in the hung write (once its thread took it), 5 in its buffer: the rest dropped and counted.
    assert blocking.written == 0 and blocking.dropped in (records - 6, records - 5)

    closed = time.monotonic()
    assert sinks["blocking"].close(timeout_s=0.3) is False  # still hung: given up on, what it held counted as dropped
    assert time.monotonic() - closed < 2.0
    assert blocking.dropped in (records - 1, records)  # all but the one in the hung write, if it took one
    release.set()  # the hung write ends: that record is written, the abandoned buffer is not
    trackers.close(timeout_s=5)
    assert sinks["good"].tracker.closed and sinks["raising"].tracker.closed and sinks["blocking"].tracker.closed
    assert blocking.written <= 1 and blocking.written + blocking.dropped == records  # each counted once


def test_a_tracker_that_fails_to_open_is_retried_and_counted():
    class FlakyOpen(ListTracker):
        name = "flaky"
        opens = 0

        def open(self) -> None:
            self.opens += 1
            if self.opens == 1:
                raise OSError("store not reachable yet")

    written: list[Point] = []
    sink = BufferedSink(FlakyOpen(written), 10)
    for step in range(3):
        sink.submit(Point("train", step, 0.0, {"train/x": 1.0}))
    assert sink.close(5)
    assert (sink.counts.errors, sink.counts.written, [p.step for p in written]) == (1, 2, [1, 2])
    assert sink.counts.last_error == "open: OSError: store not reachable yet"


# --- config ----------------------------------------------------------------------------------------


def test_tracker_config():
    assert ExperimentConfig(name="a").trackers is None
    assert ExperimentConfig(name="a", trackers=["mlflow", "tensorboard"]).trackers == ["mlflow", "tensorboard"]
    for bad in (["comet"], ["wandb", "wandb"]):
        with pytest.raises(ValidationError, match="trackers"):
            ExperimentConfig(name="a", trackers=bad)
    settings = ServerConfig(trackers={"default": ["trackio"], "wandb_mode": "offline"}).trackers
    assert settings.default == ["trackio"] and settings.buffer_records == 1000
    with pytest.raises(ValidationError, match="trackers.wandb_mode"):
        ServerConfig(trackers={"wandb_mode": "cloud"})


def test_the_default_is_trackio_where_it_is_installed(monkeypatch):
    from grpo_server.trackers import default_trackers

    assert default_trackers(ServerConfig().trackers) == ["trackio"]  # in dev, so here
    assert default_trackers(ServerConfig(trackers={"default": []}).trackers) == []  # said: none
    assert default_trackers(ServerConfig(trackers={"default": ["mlflow"]}).trackers) == ["mlflow"]
    monkeypatch.setitem(TRACKERS, "trackio", (*TRACKERS["trackio"][:2], ("trackio_library_not_installed",)))
    assert default_trackers(ServerConfig().trackers) == []  # not installed: the metrics log alone


async def test_a_tracker_without_its_library_is_refused(monkeypatch, tmp_path):
    from grpo_server.runtime.orchestrator import Orchestrator

    monkeypatch.setitem(TRACKERS, "wandb", (*TRACKERS["wandb"][:2], ("wandb_library_not_installed",)))
    assert missing_libraries(["wandb", "tensorboard"]).keys() == {"wandb"}
    orchestrator = Orchestrator(ServerConfig(run_dir=tmp_path), workers=None, prompts=None)
    # Refused before any worker is asked (workers=None would fail otherwise): a 422 naming the extra.
    with pytest.raises(Unprocessable, match=r"wandb needs wandb_library_not_installed.*grpo-server\[trackers\]") as err:
        await orchestrator.create(ExperimentConfig(name="a", trackers=["wandb"]))
    assert err.value.code == "tracker_unavailable"
    with pytest.raises(ValueError, match="trackers.default: wandb needs"):  # a server whose default cannot run
        Orchestrator(ServerConfig(run_dir=tmp_path, trackers={"default": ["wandb"]}), workers=None, prompts=None)


# --- each backend for real, read back with its own reader ---------------------------------------------------


def test_mlflow(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    feed_backend("mlflow", tmp_path)
    store = tmp_path / "trackers" / "mlflow.db"
    assert store.is_file()
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("test-mlflow").experiment_id])
    assert run.info.run_name == "exp-a" and run.info.status == "FINISHED"
    assert run.data.params["lora.r"] == "8"
    series = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
              for key in run.data.metrics}
    check_series(series)


def test_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    feed_backend("tensorboard", tmp_path)
    (folder,) = (tmp_path / "trackers" / "tensorboard" / "exp-a").iterdir()
    events = EventAccumulator(str(folder))
    events.Reload()
    # float32 in event files: the expected values that are not exact in float32 are compared with pytest.approx.
    check_series({tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]})


def test_trackio(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio-store"))  # read once, at trackio's first import
    pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    feed_backend("trackio", tmp_path)
    series: dict[str, dict[int, float]] = {}
    for row in SQLiteStorage.get_logs("test-trackio", "exp-a"):
        for key, value in row.items():
            if key not in ("step", "timestamp"):
                series.setdefault(key, {})[row["step"]] = value
    check_series(series)
    assert SQLiteStorage.get_run_config("test-trackio", "exp-a")["lora"] == {"r": 8}


def wandb_history(run_folder: Path, rows: int, timeout_s: float = 60) -> list[dict]:
    """The history rows of an offline run's `.wandb` file, once it holds `rows` of them: `run.finish()` returns
    before wandb's service process has written them (seen: the file still a bare header right after it)."""
    deadline = time.monotonic() + timeout_s
    while len(found := read_wandb_history(run_folder)) < rows and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def read_wandb_history(run_folder: Path) -> list[dict]:
    """The history rows of an offline run's `.wandb` file. wandb 0.31 has no Python reader of it any more (its Go
    core reads it), so the framing is read here: a LevelDB-style log (7-byte header, then records of a 7-byte
    header each: crc32c, length, type full/first/middle/last, in 32 KiB blocks), each record a protobuf that
    wandb's own `wandb_internal_pb2.Record` decodes."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_folder.glob("run-*.wandb")
    data, block, position, records, partial = path.read_bytes(), 32 * 1024, 7, [], b""
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if length == 0 and kind == 0:
            position += left
            continue
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            records.append(partial + chunk)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            # A key with "/" travels as its parts (`nested_key`).
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # wins over the config's online: never the network
    pytest.importorskip("wandb")
    feed_backend("wandb", tmp_path, wandb_mode="online")
    (run_folder,) = (tmp_path / "trackers" / "wandb").glob("offline-run-*")
    series: dict[str, dict[int, float]] = {}
    for row in wandb_history(run_folder, rows=1 + STEPS + STEPS):
        for key, value in row.items():
            if not key.startswith("_") and key != "learner_step":
                series.setdefault(key, {})[row["learner_step"]] = value
    check_series(series)


# --- one experiment on the real test server -------------------------------------------------------


async def test_server_experiment_reaches_its_trackers(server, client):
    for library in ("mlflow", "tensorboard", "trackio", "wandb"):
        pytest.importorskip(library)
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.serving import complete_when_admitted, wait_for

    name = "tracked-exp"
    await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1},
                                    "sampling": {"n": 2, "max_tokens": 3},
                                    "trackers": ["mlflow", "tensorboard", "trackio", "wandb"]})
    for _ in range(2):
        group = await complete_when_admitted(client, name, prompt="Pick a number")
        await client.feedback(name, group.group_id, [1.0, 0.0])

    async def pushed_and_written():
        status = await client.status(name)
        # v2's push record is written when its check ends, which may be after v2 went live
        if status.last_verification is None or status.last_verification.version < 2:
            return None
        done = all(t.written >= 4 and t.pending == 0 for t in status.trackers.values())  # 2 trains, 2 pushes
        return status if done else None

    status = await wait_for(pushed_and_written, timeout_s=300)
    assert status.trackers.keys() == {"mlflow", "tensorboard", "trackio", "wandb"}
    assert all((t.errors, t.dropped) == (0, 0) for t in status.trackers.values()), status.trackers
    await client.delete_experiment(name)  # closes the runs: everything written is in the stores

    trackers_dir = server.run_dir / "trackers"
    mlflow = MlflowClient(tracking_uri=f"sqlite:///{trackers_dir / 'mlflow.db'}")
    (run,) = mlflow.search_runs([mlflow.get_experiment_by_name("grpo_server").experiment_id],
                                filter_string=f"attributes.run_name = '{name}'")
    steps = {m.step: m.value for m in mlflow.get_metric_history(run.info.run_id, "train/reward_mean")}
    assert sorted(steps) == [1, 2] and all(value == 0.5 for value in steps.values())
    assert {m.step for m in mlflow.get_metric_history(run.info.run_id, "push/push_seconds")} == {1, 2}
    assert {m.value for m in mlflow.get_metric_history(run.info.run_id, "push/verified")} == {1.0}

    (folder,) = (trackers_dir / "tensorboard" / name).iterdir()
    events = EventAccumulator(str(folder))
    events.Reload()
    assert [e.step for e in events.Scalars("train/clipped_fraction")] == [1, 2]  # (kl: none at beta 0)
    assert [e.step for e in events.Scalars("push/mean_abs_diff")] == [1, 2]

    with sqlite3.connect(trackers_dir / "trackio" / "grpo_server.db") as db:
        rows = db.execute("SELECT step, metrics FROM metrics WHERE run_name = ?", (name,)).fetchall()
    trained = {step for step, metrics in rows if "train/reward_mean" in json.loads(metrics)}
    assert trained == {1, 2}

    (run_folder,) = [Path(p) for p in glob.glob(str(trackers_dir / "wandb" / "offline-run-*"))]
    pushes = [row for row in wandb_history(run_folder, rows=4) if "push/push_seconds" in row]
    assert sorted(row["learner_step"] for row in pushes) == [1, 2]
