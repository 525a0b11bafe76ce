"""A deleted experiment's files, archived and restored (grpo_server/protocol/archive.py), and the learner's
verbs that do it for its own files (learner/app.py `archive_experiment`, `restore_experiment`), in process
over a stand-in trainer: no model is needed to move folders. Over the real server: tests/test_tenancy.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpo_server.protocol import archive
from grpo_server.protocol.errors import ApiError
from grpo_server.protocol.verbs import ArchiveRequest


def _files(run_dir: Path, name: str, tag: str) -> dict[str, Path]:
    """The learner's and the front end's parts of an experiment, each holding `tag`."""
    entries = {"adapters": run_dir / "adapters" / name, "checkpoints": run_dir / "checkpoints" / name,
               "journal.jsonl": run_dir / "journal" / f"{name}.jsonl"}
    for entry in ("adapters", "checkpoints"):
        (entries[entry] / "v000001").mkdir(parents=True)
        (entries[entry] / "v000001" / "tag").write_text(tag)
    entries["journal.jsonl"].parent.mkdir(parents=True, exist_ok=True)
    entries["journal.jsonl"].write_text(tag)
    return entries


def test_labels_belong_to_one_name_and_sort_by_time(tmp_path):
    first, second = archive.new_label("a-b"), archive.new_label("a-b")
    assert re.fullmatch(r"a-b-\d{8}T\d{12}Z", first) and first < second
    for label in (first, second, archive.new_label("a"), archive.new_label("a-b-c")):
        (tmp_path / archive.ROOT / label).mkdir(parents=True)
    (tmp_path / archive.ROOT / "a-b-not-a-stamp").mkdir()
    assert archive.labels(tmp_path, "a-b") == [first, second]  # not a's, a-b-c's or a stray folder
    assert archive.check_label("a-b", first) == first
    for bad in ("a-b", "../a-b-20250101T000000000000Z", archive.new_label("a"), "a-b-20250101T000000000000Z/x"):
        with pytest.raises(ApiError) as info:
            archive.check_label("a-b", bad)
        assert info.value.status == 400


def test_move_out_and_back(tmp_path):
    entries = _files(tmp_path, "exp", "life-1")
    label = archive.new_label("exp")
    assert archive.move_out(tmp_path, label, entries) == list(entries)
    assert not archive.live(entries)
    assert (archive.folder(tmp_path, label) / "adapters" / "v000001" / "tag").read_text() == "life-1"
    assert archive.move_out(tmp_path, archive.new_label("exp"), entries) == []  # nothing live: no folder
    assert archive.labels(tmp_path, "exp") == [label]
    assert archive.newest(tmp_path, "exp", entries) == label

    _files(tmp_path, "exp", "life-2")  # a new life of the name is in the way: nothing moves
    with pytest.raises(ApiError) as info:
        archive.move_back(tmp_path, label, entries)
    assert info.value.code == "archive_conflict" and archive.folder(tmp_path, label).is_dir()
    second = archive.new_label("exp")
    archive.move_out(tmp_path, second, entries)
    assert archive.move_back(tmp_path, label, entries) == list(entries)
    assert entries["journal.jsonl"].read_text() == "life-1"
    assert not archive.folder(tmp_path, label).exists()  # emptied, so removed
    assert archive.newest(tmp_path, "exp", entries) == second


def test_prune_keeps_the_newest_archives_of_any_name(tmp_path):
    made = [archive.new_label(name) for name in ("a", "b", "a", "c", "b")]  # in time order
    for label in made:
        (archive.folder(tmp_path, label) / "adapters").mkdir(parents=True)
    (tmp_path / archive.ROOT / "not-an-archive").mkdir()
    assert archive.prune(tmp_path, 3) == made[:2]  # the oldest two, whatever their names
    assert sorted(p.name for p in (tmp_path / archive.ROOT).iterdir()) == sorted([*made[2:], "not-an-archive"])
    assert archive.prune(tmp_path, 3) == []
    assert archive.prune(tmp_path, 0) == made[2:] and archive.labels(tmp_path, "a") == []
    assert archive.prune(tmp_path / "nothing-here", 1) == []


class _Trainer:
    """What LearnerHandler asks of a trainer to move files: which experiments it holds."""

    def __init__(self, *names: str):
        self.names = set(names)

    def status(self) -> dict[str, dict]:
        return {name: {} for name in self.names}


@pytest.fixture
def handler(tmp_path):
    from learner.app import LearnerHandler

    return LearnerHandler(_Trainer("held"), tmp_path)


async def test_learner_archives_and_restores_its_own_files(handler, tmp_path):
    entries = _files(tmp_path, "exp", "life-1")
    label = archive.new_label("exp")
    assert (await handler.archive_experiment(ArchiveRequest(name="exp", label=label))).label == label
    assert entries["journal.jsonl"].exists()  # the front end's part is the front end's to move
    assert not entries["adapters"].exists() and not entries["checkpoints"].exists()
    again = await handler.archive_experiment(ArchiveRequest(name="exp", label=archive.new_label("exp")))
    assert again.label is None  # nothing left to archive

    restored = await handler.restore_experiment(ArchiveRequest(name="exp"))  # the newest
    assert (restored.label, restored.live) == (label, False)
    assert (entries["adapters"] / "v000001" / "tag").read_text() == "life-1"
    live = await handler.restore_experiment(ArchiveRequest(name="exp"))
    assert (live.label, live.live) == (None, True)  # files never archived resume as they are
    nothing = await handler.restore_experiment(ArchiveRequest(name="other"))
    assert (nothing.label, nothing.live) == (None, False)

    # With `keep` (the server's archives_kept), the archives beyond the newest go after the move, whatever names.
    older = archive.new_label("old")
    (archive.folder(tmp_path, older) / "adapters").mkdir(parents=True)
    _files(tmp_path, "exp2", "life-1")
    kept = await handler.archive_experiment(ArchiveRequest(name="exp2", label=archive.new_label("exp2"), keep=1))
    assert kept.label is not None and archive.labels(tmp_path, "exp2") == [kept.label]
    assert not archive.folder(tmp_path, older).exists()


@pytest.mark.parametrize("verb, request_, code", [
    ("archive_experiment", {"name": "held", "label": "held-20250101T000000000000Z"}, "experiment_live"),
    ("restore_experiment", {"name": "held"}, "experiment_live"),
    ("archive_experiment", {"name": "exp"}, "bad_request"),  # archiving needs its label
    ("archive_experiment", {"name": "exp", "label": "../../etc"}, "bad_archive_label"),
    ("restore_experiment", {"name": "exp", "label": "other-20250101T000000000000Z"}, "bad_archive_label"),
])
async def test_learner_refuses_what_it_must_not_move(handler, tmp_path, verb, request_, code):
    _files(tmp_path, "held", "in use")
    with pytest.raises(ApiError) as info:
        await getattr(handler, verb)(ArchiveRequest(**request_))
    assert info.value.code == code
    assert (tmp_path / "adapters" / "held" / "v000001" / "tag").read_text() == "in use"


def test_a_name_that_is_no_experiment_name_is_refused_by_the_verb_s_model():
    """Over HTTP a ValidationError is the worker's 400 bad_request (protocol/dispatch.py): the path never forms."""
    from pydantic import ValidationError

    for name in ("../exp", "a/b", "/abs", "Exp"):
        with pytest.raises(ValidationError):
            ArchiveRequest(name=name)
