"""Run files are the owner's and its group's only (issue 57, item 7): after a real server trained a step, pushed a
version, kept a Tinker session and archived a deleted experiment, no file or folder of its run directory is
readable, writable or enterable by other users (mode & 0o007 == 0). The front end and its workers run under
umask 0o027 (grpo_server/protocol/durable.py restrict_umask), and the files they create with an explicit mode
(the journal, write_atomic's, the learner's adapter versions) are 0640 at most."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import aiohttp

from tests.serving import complete_when_admitted, wait_for
from tests.test_learning import learning_config

# Written by the tests' harness (tests/serving.py), not by the server.
HARNESS_FILES = {"server.yaml", "server.log"}


def open_to_others(run_dir: Path) -> list[str]:
    found = []
    for root, folders, files in os.walk(run_dir):
        for name in folders + files:
            path = Path(root) / name
            if path.parent == run_dir and name in HARNESS_FILES:
                continue
            mode = path.lstat().st_mode
            if not stat.S_ISLNK(mode) and mode & 0o007:
                found.append(f"{oct(stat.S_IMODE(mode))} {path.relative_to(run_dir)}")
    return found


async def _version(client, name: str, version: int):
    status = await client.status(name)
    return status if status.policy_version >= version else None


async def test_no_run_file_is_open_to_other_users(server, client):
    name = "run-files"
    await client.create_experiment(learning_config(name, batch_groups=1))
    group = await complete_when_admitted(client, name, prompt="Hello", n=4, max_tokens=2)
    await client.feedback(name, group.group_id, [1.0, 0.0, 0.0, 1.0])
    await wait_for(lambda: _version(client, name, 1), timeout_s=180)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {server.api_key}"}) as http:
        async with http.post(f"{server.url}/api/v1/create_session", json={"sdk_version": "test"}) as response:
            assert response.status == 200, await response.text()
    run_dir = server.run_dir
    written = {p.relative_to(run_dir).parts[0] for p in run_dir.rglob("*") if p.is_file()}
    assert {"journal", "metrics", "experiments", "adapters", "logs", "config", "tinker"} <= written, written
    assert open_to_others(run_dir) == []
    await client.delete_experiment(name)  # its files move into archive/
    assert any((run_dir / "archive").glob(f"{name}-*"))
    assert open_to_others(run_dir) == []
