"""The Tinker API's sessions and models, kept across front-end restarts in `<run_dir>/tinker/models.json`.

A Tinker model is an experiment, and experiments already survive a restart (the experiment registry, the
learner's versions and saved states). What only the Tinker API knows is kept here: which session each key
opened, which model id names which experiment and who owns it, and the names its sampler weights were saved
under. Without it a restart left every `tinker://{model_id}/...` path a 404, so a cookbook run could not
resume from the checkpoint it had saved (`create_training_client_from_state_with_optimizer`).

Not kept: samplers (a new one on a saved path costs nothing) and futures (a restarted server has no calls in
flight; the SDK retries a lost one). A model whose experiment is gone (deleted, or archived) is dropped at load.

The file is small (one entry per model and session) and rewritten whole on each change, durably
(protocol/durable.py), on a thread; one write at a time.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any, Callable, TypeVar

from grpo_server.api.tinker import schema as ts
from grpo_server.protocol.durable import write_atomic

# service.py's TinkerModel, which this module reads and makes through `make_model` without importing service.py
# (which imports this one): no circle, even for the type checker.
TinkerModel = TypeVar("TinkerModel")

log = logging.getLogger(__name__)

FORMAT = 1


class TinkerRegistry:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "tinker" / "models.json"
        self._writing = asyncio.Lock()

    def load(self, make_model: Callable[..., TinkerModel], weights: Callable[..., Any],
             experiment_exists: Callable[[str], bool]) -> tuple[dict[str, str], dict[str, TinkerModel]]:
        """(sessions, models) as last saved; nothing if there is no file. A file this version cannot read is
        logged and left in place (not overwritten until the next change), and the API starts empty."""
        if not self.path.exists():
            return {}, {}
        try:
            saved = json.loads(self.path.read_text())
            if saved.get("format") != FORMAT:
                raise ValueError(f"format {saved.get('format')!r}, not {FORMAT}")
            sessions = {str(k): str(v) for k, v in saved["sessions"].items()}
            models = {}
            for row in saved["models"]:
                if not experiment_exists(row["experiment"]):
                    continue
                models[row["model_id"]] = make_model(
                    model_id=row["model_id"], experiment=row["experiment"], owner=row["owner"],
                    lora=ts.LoraConfig.model_validate(row["lora"]), probe_tokens=row.get("probe_tokens"),
                    created_at=row["created_at"], step=row.get("step", 0), expires=row.get("expires", {}),
                    sampler_weights={name: weights(**w) for name, w in row["sampler_weights"].items()})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("tinker: %s could not be read (%s); starting with no Tinker sessions or models", self.path, exc)
            return {}, {}
        log.info("tinker: %d models and %d sessions from %s", len(models), len(sessions), self.path)
        return sessions, models

    async def save(self, sessions: dict[str, str], models: dict[str, TinkerModel]) -> None:
        """Write the state as it is now. The snapshot is taken on the event loop, so a change made while an
        earlier write runs is in the next one."""
        async with self._writing:
            data = json.dumps({"format": FORMAT, "sessions": sessions,
                               "models": [_row(m) for m in models.values()]}).encode()
            await asyncio.to_thread(self._write, data)

    def _write(self, data: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, data)


def _row(model: TinkerModel) -> dict[str, Any]:
    return {"model_id": model.model_id, "experiment": model.experiment, "owner": model.owner,
            "lora": model.lora.model_dump(), "probe_tokens": model.probe_tokens, "created_at": model.created_at,
            "step": model.step, "expires": model.expires,
            "sampler_weights": {name: {"version": w.version, "path": w.path, "saved_at": w.saved_at}
                                for name, w in model.sampler_weights.items()}}
