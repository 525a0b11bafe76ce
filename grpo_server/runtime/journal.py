"""The feedback journal and the experiment registry: what the front end must not lose in a crash.

Feedback journal: one append-only file per experiment, `run_dir/journal/{name}.jsonl`. Every rated group
the server accepts (a 202 that will be trained) is written and fsynced there, with a sequence number,
before the answer goes out. The learner's checkpoints record the newest sequence number their weights
include (`journal_seq`); after any restart the groups after it are queued again, so an accepted group is
in the weights exactly once. Entries a checkpoint covers are compacted away (the file is rewritten to a
temporary name and renamed), so the file holds only feedback the learner has not made durable yet.

Experiment registry: `run_dir/experiments/{name}.json`, the config of every live experiment (with its
API key, so the file is 0600), so `grpo-server serve` on the same run directory brings them all back.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from grpo_server.config import ExperimentConfig
from grpo_server.protocol.wire import Completion
from grpo_server.runtime.groups import Group

log = logging.getLogger(__name__)


def group_record(group: Group) -> dict[str, Any]:
    return {
        "seq": group.journal_seq, "group_id": group.group_id, "experiment": group.experiment,
        "prompt_token_ids": group.prompt_token_ids, "completions": [c.model_dump() for c in group.completions],
        "policy_version": group.policy_version, "temperature": group.temperature, "top_p": group.top_p,
        "max_tokens": group.max_tokens,
        "rewards": group.rewards, "advantages": group.advantages,
        "sampled_step": group.sampled_step,  # absent in older journals: 0, counted from the first step
        **({} if group.episode_of is None else {"episode_of": group.episode_of,
                                                "sequence_prompts": group.sequence_prompts,
                                                "loss_masks": group.loss_masks}),
    }


def group_from_record(record: dict[str, Any]) -> Group:
    fields = dict(record)
    seq = fields.pop("seq")
    fields["completions"] = [Completion(**c) for c in fields["completions"]]
    return Group(**fields, journal_seq=seq)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FeedbackJournal:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_torn_tail()
        self.last_seq = max((r["seq"] for r in self._records()), default=0)
        self._file = open(self.path, "ab")

    def _drop_torn_tail(self) -> None:
        """A crash mid-append leaves a last line without its newline (that group never got its 202):
        cut it, or the next append would be glued to it."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            log.warning("%s: dropping an incomplete last line (%d bytes)", self.path, len(data) - data.rfind(b"\n") - 1)
            with open(self.path, "r+b") as handle:
                handle.truncate(data.rfind(b"\n") + 1)
                os.fsync(handle.fileno())

    def _records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        records = []
        with open(self.path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                try:
                    records.append(json.loads(line))
                except ValueError:  # not written by append (which only ever adds whole lines)
                    log.warning("%s: line %d is not a journal record, skipped", self.path, number)
        return records

    def append(self, group: Group) -> int:
        """Write the group durably and return its sequence number (also set on the group)."""
        group.journal_seq = self.last_seq + 1
        self._file.write(json.dumps(group_record(group), separators=(",", ":")).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.last_seq = group.journal_seq
        return group.journal_seq

    def pending(self, after_seq: int) -> list[Group]:
        """Journalled groups not in the learner's weights (sequence number > after_seq), oldest first."""
        return [group_from_record(r) for r in sorted(self._records(), key=lambda r: r["seq"]) if r["seq"] > after_seq]

    def compact(self, through_seq: int) -> None:
        """Forget entries up to `through_seq`: the learner's checkpoint holds them."""
        keep = [r for r in self._records() if r["seq"] > through_seq]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as handle:
            for record in keep:
                handle.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        self._file.close()
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self._file = open(self.path, "ab")

    def close(self) -> None:
        self._file.close()


class ExperimentRegistry:
    def __init__(self, run_dir: Path):
        self.root = Path(run_dir) / "experiments"

    def save(self, config: ExperimentConfig) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        body = config.model_dump(mode="json")
        body["api_key"] = config.api_key.get_secret_value() if config.api_key else None
        path = self.root / f"{config.name}.json"
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(body, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.root)

    def remove(self, name: str) -> None:
        (self.root / f"{name}.json").unlink(missing_ok=True)

    def load_all(self) -> list[ExperimentConfig]:
        if not self.root.is_dir():
            return []
        return [ExperimentConfig.model_validate(json.loads(path.read_text()))
                for path in sorted(self.root.glob("*.json"))]
