"""Workers on two "hosts" with no path in common (docs/multi-host.md), on loopback.

Host A runs the front end and rank 0 of the learner over run directory A; host B runs the sampler and rank 1
over run directory B, in a mount namespace where run directory A is hidden (an empty tmpfs over it), so the only
way for an adapter version to reach B's sampler is the learner's HTTP. Training steps push versions that B serves
(the front end's push check compares B's logprobs with the learner's), the learner job killed whole resumes from
rank 0's checkpoint. One topology for all of it: each costs a minute of the suite (a front end, two learner ranks, a
sampler) to start and train. (A sampler restarted is re-synced the same way, tests/test_roles.py's `served_again`
on split roles; its copies of old versions are swept, tests/test_adapter_transfer.py.)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_server.client import AsyncClient
from grpo_server.protocol.adapter_files import holds, read_fingerprint
from tests.serving import (ADMIN_KEY, STARTUP_TIMEOUT_S, TINY_KV_CACHE_GIB, VERIFY_IDLE_S, adapter_versions, free_port,
                           wait_for, worker_env)
from tests.test_roles import end, sampler_adapters, wait_for_port

HIDE = ["unshare", "--mount", "--map-root-user", "--propagation", "private", "sh", "-c",
        'mount -t tmpfs none "$0" && exec "$@"']


def can_hide_a_folder() -> bool:
    """A mount namespace (root, or unprivileged user namespaces): how one machine plays a second host."""
    try:
        return subprocess.run([*HIDE, "/tmp", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def spawn(host_dir: Path, config: Path, role: str, *args: str, hide: Path | None = None) -> subprocess.Popen:
    log = open(host_dir / f"{role}{''.join(args)}.log", "ab")
    command = [sys.executable, "-m", "grpo_server.cli", "serve", "--role", role, "--config", str(config), *args]
    # The same worker secret on both hosts, in each process's environment (docs/multi-host.md).
    return subprocess.Popen([*HIDE, str(hide), *command] if hide else command, stdout=log, stderr=subprocess.STDOUT,
                            env=worker_env(), start_new_session=True)


def host_config(host_dir: Path, model: Path, front_port: int, sampler_url: str, learner_url: str) -> Path:
    """One host's server config: the same workers' URLs on both hosts, each host its own run directory."""
    host_dir.mkdir()
    path = host_dir / "server.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(model), "host": "127.0.0.1", "port": front_port, "run_dir": str(host_dir / "run"),
        "api_key": ADMIN_KEY, "max_model_len": 512, "startup_timeout_s": STARTUP_TIMEOUT_S, "worker_timeout_s": 120,
        "dtype": "float32", "verify_tolerance": 0.01,  # exact on either CPU generation (auto: bf16 on one)
        "verify_idle_s": VERIFY_IDLE_S,
        "sampler": {"urls": [sampler_url], "engine": "vllm", "kv_cache_gib": TINY_KV_CACHE_GIB, "max_num_seqs": 16,
                    "compile": False},
        "learner": {"url": learner_url, "zero_stage": 2},
    }))
    return path


async def _served(client: AsyncClient, name: str, at_least: int) -> int | None:
    version = (await client.status(name)).policy_version
    return version if version >= at_least else None


async def _verified(client: AsyncClient, name: str, version: int):
    check = (await client.status(name)).last_verification
    return check if check is not None and check.version == version and check.checked_on == "probe" else None


async def _worker_state(client: AsyncClient, worker: str, state: str) -> bool:
    return (await client.health()).workers.get(worker) == state


# --- the learner as a two-node torchrun job: rank 0 on host A, rank 1 on host B ------------------------


def test_a_rank_is_the_launchers_only_when_it_says_so():
    from learner.ranks import launcher_env

    torchrun_vars = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "hosta", "MASTER_PORT": "29500"}
    env = launcher_env(torchrun_vars)
    assert (env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port) == (3, 1, 4, "hosta", 29500)
    assert env.launched and env.variables()["MASTER_ADDR"] == "hosta"
    # A follower that rank 0 started has no MASTER_PORT yet (it comes on stdin); one rank alone is no job.
    assert launcher_env({**torchrun_vars, "MASTER_PORT": ""}) is None
    assert launcher_env({**torchrun_vars, "WORLD_SIZE": "1", "RANK": "0"}) is None
    assert launcher_env({}) is None


def torchrun(host_dir: Path, config: Path, node: int, master_port: int, hide: Path | None = None) -> subprocess.Popen:
    """One node of `torchrun --nnodes 2 ... -m grpo_server.cli serve --role learner` (docs/multi-host.md)."""
    log = open(host_dir / f"learner-node{node}.log", "ab")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master_port),
               "-m", "grpo_server.cli", "serve", "--role", "learner", "--config", str(config)]
    return subprocess.Popen([*HIDE, str(hide), *command] if hide else command, stdout=log, stderr=subprocess.STDOUT,
                            env=worker_env(), start_new_session=True)


def child_pid(parent: subprocess.Popen) -> int:
    out = subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


def end_node(node: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """The launcher and its rank: torchrun starts each rank in a session of its own."""
    if node.poll() is None:
        for pid in subprocess.run(["pgrep", "-P", str(node.pid)], capture_output=True, text=True).stdout.split():
            os.kill(int(pid), sig)
    end(node, sig)


@pytest.mark.skipif(not can_hide_a_folder(), reason="no mount namespaces here (unshare --mount)")
async def test_a_learner_over_two_hosts_under_torchrun(tiny_model_dir, tmp_path):
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    front_port, sampler_port, learner_port, master_port = free_port(), free_port(), free_port(), free_port()
    sampler_url, learner_url = f"http://127.0.0.1:{sampler_port}", f"http://127.0.0.1:{learner_port}"
    config_a = host_config(host_a, tiny_model_dir, front_port, sampler_url, learner_url)
    config_b = host_config(host_b, tiny_model_dir, front_port, sampler_url, learner_url)
    nodes = [torchrun(host_a, config_a, 0, master_port), torchrun(host_b, config_b, 1, master_port, hide=host_a)]
    sampler = spawn(host_b, config_b, "sampler", "--replica", "0", hide=host_a)
    frontend = spawn(host_a, config_a, "frontend")
    url, name = f"http://127.0.0.1:{front_port}", "multinode"
    copies = host_b / "run" / "adapter-copies" / "sampler-0" / name
    try:
        wait_for_port(front_port, frontend, host_a / "frontend.log")
        async with AsyncClient(url, ADMIN_KEY) as client:
            await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1, "learning_rate": 1e-2},
                                            "sampling": {"n": 2, "max_tokens": 4}})
            for expected in (1, 2):
                if expected == 2:
                    # The job dies whole (a host lost) and is started again: rank 0 reads the checkpoint on A
                    # for both ranks, so rank 1 on B resumes the same step without seeing A's disk.
                    for node in nodes:
                        end_node(node, signal.SIGKILL)
                    await wait_for(lambda: _worker_state(client, "learner", "down"), timeout_s=60)
                    nodes = [torchrun(host_a, config_a, 0, master_port),
                             torchrun(host_b, config_b, 1, master_port, hide=host_a)]
                    await wait_for(lambda: _worker_state(client, "learner", "ready"), timeout_s=STARTUP_TIMEOUT_S)
                group = await client.complete(name, prompt="Pick a number")
                await client.feedback(name, group.group_id, [1.0, 0.0])
                version = await wait_for(lambda: _served(client, name, at_least=expected), timeout_s=300)
                checked = await wait_for(lambda: _verified(client, name, version), timeout_s=60)
                assert checked.ok
            status = await client.status(name)
            assert status.step == 2 and status.counters.groups_trained == 2

            # B serves exactly what the learner wrote on A, and only the learner's HTTP took it there: its copy is
            # that version, byte for byte, and the push check above found its logprobs the learner's.
            assert version in adapter_versions(await sampler_adapters(sampler_url), name)
            learner_copy = host_a / "run" / "adapters" / name / f"v{version:06d}"
            b_copy, = copies.glob(f"v{version:06d}.*")  # one per life of the name (AdapterRef.life)
            assert holds(b_copy, read_fingerprint(learner_copy))
            assert (b_copy / "adapter_model.safetensors").read_bytes() == \
                (learner_copy / "adapter_model.safetensors").read_bytes()
            log_b = (host_b / "sampler--replica0.log").read_text(errors="replace")
            assert re.search(rf"{name}@v{version}\.[0-9a-f]+: {re.escape(str(learner_copy.resolve()))} not readable "
                             "here; copied", log_b)

        rank1 = (host_b / "learner-node1.log").read_text(errors="replace")
        assert "rank 1 of 2 ready" in rank1
        assert f"experiment {name}: adapter r=" in rank1 and "from checkpoint at v" in rank1
        checkpoints = host_a / "run" / "checkpoints" / name
        assert list(checkpoints.glob("step*/optimizer.rank1.pt"))  # rank 0 writes rank 1's shard on A
        assert not (host_b / "run" / "checkpoints").exists() and not (host_b / "run" / "adapters").exists()

        # Stopping the job: SIGTERM to rank 0 (what Ctrl-C on node 0 sends it), which checkpoints and stops
        # rank 1; both launchers then end with 0.
        assert end(frontend, signal.SIGINT) == 0
        os.kill(child_pid(nodes[0]), signal.SIGTERM)
        assert [node.wait(timeout=120) for node in nodes] == [0, 0]
        assert "stopping as rank 0 asked" in (host_b / "learner-node1.log").read_text(errors="replace")
    finally:
        for process in (frontend, sampler):
            if process.poll() is None:
                end(process)
        for node in nodes:
            end_node(node)
