"""A restart brings every experiment back that its files allow, and holds the others (issues 50 and 51), on the real
server (tiny model, real learner with ZeRO-2, HTTP on loopback):

- an experiment whose checkpoint was written the way CPython 3.11.2 (Debian 12's, the image's) pickles an Enum,
  `getattr(ZeroStageEnum, 'gradients')`, resumes with its optimizer state;
- an experiment whose checkpoint cannot be read does not stop the server: it is listed as `failed` with the
  reason, its key is told why (503), and an admin restores it once the file is mended, or deletes it;
- a restored experiment's recent reward is read back from its metrics log, and the demo's summary prints it;
- an experiment an admin paused comes back paused (it samples nothing until unpaused).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import torch

from grpo_server.client import AsyncClient, Client, GrpoServerError
from learner import checkpoint
from learner.plain_data import load_data
from scripts import demo_summary
from tests.serving import (ADMIN_KEY, complete_when_admitted, post_json, start_server, stop_server,
                           train_one_version, wait_for)

KEYS = {name: f"{name}-key-5f1e2d3c4b" for name in ("kept", "mended", "doomed")}


def _config(name: str) -> dict:
    return {"name": name, "api_key": KEYS[name], "sampling": {"n": 2, "max_tokens": 3},
            "algorithm": {"batch_groups": 1, "checkpoint_every": 1, "checkpoint_interval_s": 0,
                          "max_staleness": 1000, "learning_rate": 1e-3}}


def _newest_optimizer_file(run_dir: Path, name: str) -> Path:
    step = checkpoint.list_steps(run_dir, name)[-1]
    return checkpoint.checkpoint_root(run_dir, name) / f"step{step:08d}" / checkpoint.OPTIMIZER_FILE


def _write_as_python_3_11_2(path: Path) -> None:
    """The file as the earlier format wrote it on CPython 3.11.2: the DeepSpeed objects pickled as they are, an
    Enum member through getattr."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    state = load_data(path)
    assert any(isinstance(v, ZeroStageEnum) for v in state.values())  # the real ZeRO-2 state has one
    reduce = ZeroStageEnum.__reduce_ex__
    ZeroStageEnum.__reduce_ex__ = lambda self, proto: (getattr, (type(self), self._name_))
    try:
        torch.save(state, path)
    finally:
        ZeroStageEnum.__reduce_ex__ = reduce
    assert b"getattr" in path.read_bytes()


async def train_one_more_version(client: AsyncClient, name: str) -> None:
    start = (await client.status(name)).policy_version

    async def pushed():
        group = await complete_when_admitted(client, name, prompt="Pick a number")
        await client.feedback(name, group.group_id, [1.0, 0.0])
        return (await client.status(name)).policy_version > start

    await wait_for(pushed, timeout_s=300)


async def test_a_restart_restores_what_it_can_and_holds_the_rest(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    server = start_server(run_dir, tiny_model_dir)
    try:
        async with AsyncClient(server.url, ADMIN_KEY) as admin:
            for name in KEYS:
                await admin.create_experiment(_config(name))
            await asyncio.gather(*(train_one_version(admin, name) for name in KEYS))
            before = {name: await admin.status(name) for name in KEYS}
            assert (await admin.pause_experiment("kept")).paused  # an admin's pause outlasts the restart
    finally:
        stop_server(server)
    assert before["kept"].recent_reward_mean == 0.5  # every group rated (1, 0)

    _write_as_python_3_11_2(_newest_optimizer_file(run_dir, "kept"))
    mended = _newest_optimizer_file(run_dir, "mended")
    good = mended.read_bytes()
    for name in ("mended", "doomed"):
        _newest_optimizer_file(run_dir, name).write_bytes(b"not a checkpoint")
    # Saved configs this version no longer takes (issue 57): a name now reserved, and a damaged file. Each is held
    # as failed with its reason; the server starts with the others.
    saved = run_dir / "experiments"
    (saved / "admin.json").write_text(json.dumps({**_config("kept"), "name": "admin", "api_key": "would-be-admin-key-0a1b2c"}))
    (saved / "damaged.json").write_text('{"name": "damaged", "sampling": {"n": ')

    server = start_server(run_dir, tiny_model_dir)
    try:
        async with AsyncClient(server.url, ADMIN_KEY) as admin:
            listed = {s.name: s for s in await admin.list_experiments()}
            assert {n: s.state for n, s in listed.items()} == {
                "kept": "active", "mended": "failed", "doomed": "failed", "admin": "failed", "damaged": "failed"}
            assert "admin.json" in listed["admin"].errors[0] and "reserved" in listed["admin"].errors[0]
            assert "damaged.json" in listed["damaged"].errors[0]
            for invalid in ("admin", "damaged"):
                async with aiohttp.ClientSession() as session:
                    status, body = await post_json(session, f"{server.url}/v1/experiments/{invalid}/restore", None)
                assert status == 409 and body["error"]["code"] == "experiment_invalid", body
            async with AsyncClient(server.url, "would-be-admin-key-0a1b2c") as impostor:  # its key is not read
                try:
                    await impostor.list_experiments()
                    raise AssertionError("an invalid saved config's key authenticated")
                except GrpoServerError as exc:
                    assert exc.status == 401, exc
            await admin.delete_experiment("damaged")
            assert not (saved / "damaged.json").exists()
            kept = listed["kept"]
            # Resumed, not restarted: groups journalled before the stop may have trained since.
            assert kept.step >= before["kept"].step >= 1 and kept.policy_version >= before["kept"].policy_version
            assert "fresh optimizer" not in server.log_path.read_text()
            assert kept.recent_reward_mean == 0.5, "the recent reward is read back from the metrics log"
            assert "could not be restored" in listed["doomed"].errors[0]
            assert [n for n, s in listed.items() if s.paused] == ["kept"]
            try:
                await admin.complete("kept", prompt="Pick a number")
                raise AssertionError("a paused experiment sampled after a restart")
            except GrpoServerError as exc:
                assert exc.status == 503 and exc.code == "experiment_paused", exc
            assert not (await admin.unpause_experiment("kept")).paused
            assert "cannot read the checkpoint file" in server.log_path.read_text()  # the log names the file

            async with AsyncClient(server.url, KEYS["doomed"]) as tenant:  # its key still authenticates
                assert (await tenant.status("doomed")).state == "failed"
                try:
                    await tenant.complete("doomed", prompt="Pick a number")
                    raise AssertionError("an unrestored experiment sampled")
                except GrpoServerError as exc:
                    assert exc.status == 503 and exc.code == "experiment_unrestored", exc
            try:
                await admin.create_experiment({**_config("doomed"), "api_key": "another-key-9a8b7c6d5e"})
                raise AssertionError("a name held as failed was created again")
            except GrpoServerError as exc:
                assert exc.status == 409 and exc.code == "experiment_exists"

            async with aiohttp.ClientSession() as session:
                restore = f"{server.url}/v1/experiments/mended/restore"
                status, body = await post_json(session, restore, None)
                assert status == 502, body  # still unreadable: held again
                assert (await admin.status("mended")).state == "failed"
                mended.write_bytes(good)
                status, body = await post_json(session, restore, None)
                assert status == 200 and body["state"] == "active", body
                status, body = await post_json(session, restore, None)
                assert status == 409 and body["error"]["code"] == "experiment_running", body
            await admin.delete_experiment("doomed")
            assert {s.name for s in await admin.list_experiments()} == {"kept", "mended", "admin"}
            assert not checkpoint.list_steps(run_dir, "doomed")  # archived, as a delete does

            # Both resumed experiments keep training.
            await asyncio.gather(*(train_one_more_version(admin, name) for name in ("kept", "mended")))

        # scripts/demo's summary, on the experiments its tasks trained (here: named in their summaries).
        (run_dir / "alphabetize-reward.json").write_text('{"experiment": "kept"}')
        names = demo_summary.trained_experiments(run_dir, ["alphabetize", "nothing-ran"])
        assert names == ["kept", "nothing-ran"]

        def summary() -> list[str]:
            with Client(server.url, ADMIN_KEY) as client:
                return demo_summary.summary_lines(client, names)

        lines = await asyncio.to_thread(summary)
        assert lines[0].startswith("kept: version ") and "recent reward 0.500" in lines[0]
        assert lines[1].startswith("nothing-ran: no status")
    finally:
        stop_server(server)
