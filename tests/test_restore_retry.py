"""A saved experiment whose restore at start failed for a reason that passes (a 503: the learner's disk full, a
worker timing out) is tried again until it is back; one that failed for another reason waits for an admin
(grpo_server/runtime/orchestrator.py `start_saved`). The chaos soak found a full disk at a restart leaving
experiments held until an admin came. The whole path on a real server, with an unreadable checkpoint:
tests/test_restart_restore.py."""

from __future__ import annotations

import asyncio

from grpo_server.config import ExperimentConfig, ServerConfig
from grpo_server.protocol.errors import Unavailable, Unprocessable
from grpo_server.runtime import orchestrator as orchestrator_module
from grpo_server.runtime.orchestrator import Orchestrator


async def test_a_restore_that_failed_for_a_passing_reason_is_tried_again_until_it_is_back(tmp_path, monkeypatch):
    monkeypatch.setattr(orchestrator_module, "RESTORE_RETRY_S", 0.05)
    orchestrator = Orchestrator(ServerConfig(run_dir=tmp_path), workers=None, prompts=None)
    failures = {"full": [Unavailable("learner: the run directory's disk is full", code="disk_full")] * 3,
                "broken": [Unprocessable("learner: an unreadable checkpoint", code="checkpoint_unreadable")] * 99}
    created = []

    async def create(config, start):  # the learner's side, as it answers
        if failures[config.name]:
            raise failures[config.name].pop(0)
        created.append((config.name, start))

    monkeypatch.setattr(orchestrator, "_create", create)
    await orchestrator.start_saved([ExperimentConfig(name="full"), ExperimentConfig(name="broken")])
    assert set(orchestrator.unrestored) == {"full", "broken"}  # both held at first, each with its reason
    for _ in range(100):
        if "full" not in orchestrator.unrestored:
            break
        await asyncio.sleep(0.02)
    assert created == [("full", "restart")] and not failures["full"]  # back after three passing failures
    await asyncio.sleep(0.3)
    assert "broken" in orchestrator.unrestored and len(failures["broken"]) == 98  # tried once: an admin's now
    await orchestrator.upkeep.stop()
