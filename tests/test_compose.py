"""docker-compose.cpu.yml: the split deployment on one CPU host, checked as a file here and, where Docker
answers, built and run for real by scripts/compose-check (CI machines have no Docker: skipped there)."""

from __future__ import annotations

import os
import subprocess
from urllib.parse import urlsplit

import pytest
import yaml

from grpo_server.protocol.worker_auth import SECRET_ENV
from scripts.compose_check import COMPOSE_FILE, compose_command, works
from tests.serving import WORKER_SECRET
from tests.test_roles import REPO, interpolate, option

CPU_FILE = REPO / COMPOSE_FILE


def cpu_services() -> dict[str, dict]:
    return yaml.safe_load(interpolate(CPU_FILE.read_text(), {"GRPO_SERVER_API_KEY": "x", SECRET_ENV: WORKER_SECRET}))[
        "services"]


def test_cpu_compose_runs_each_role_in_its_own_container_on_loopback_ports(monkeypatch):
    from grpo_server.config import load_server_config
    from grpo_server.serve import check_role

    monkeypatch.setenv(SECRET_ENV, WORKER_SECRET)  # as compose gives it to every service (checked below)

    services = cpu_services()
    assert set(services) == {"frontend", "sampler-0", "learner"}
    ports = []
    for name, service in services.items():
        command = service["command"]
        assert command[:2] == ["grpo-server", "serve"], name
        assert service["environment"][SECRET_ENV] == WORKER_SECRET, name  # every role, the same one
        role, replica = option(command, "--role"), option(command, "--replica")
        config = load_server_config(REPO / option(command, "--config"))
        check_role(config, role, None if replica is None else int(replica))  # raises if they do not fit
        # The host's network, no GPU, nothing published: each process on its own 127.0.0.1 port.
        assert service["network_mode"] == "host" and "deploy" not in service and "ports" not in service, name
        assert service["restart"] == "unless-stopped" and service["init"] is True, name
        url = {"frontend": f"http://{config.host}:{config.port}", "learner": config.learner.url,
               "sampler": (config.sampler.urls or [""])[int(replica or 0)]}[role]
        assert urlsplit(url).hostname == "127.0.0.1", (name, url)
        health = "/v1/health" if role == "frontend" else "/health"
        assert service["healthcheck"]["test"][-1] == f"http://127.0.0.1:{urlsplit(url).port}{health}", name
        ports.append(urlsplit(url).port)
    assert len(set(ports)) == len(ports), ports


def test_cpu_compose_needs_the_admin_key_and_the_worker_secret():
    with pytest.raises(KeyError, match="GRPO_SERVER_API_KEY"):
        interpolate(CPU_FILE.read_text(), {SECRET_ENV: WORKER_SECRET})
    with pytest.raises(KeyError, match=SECRET_ENV):
        interpolate(CPU_FILE.read_text(), {"GRPO_SERVER_API_KEY": "x"})


COMPOSE = compose_command()


@pytest.mark.skipif(COMPOSE is None, reason="neither `docker compose` nor docker-compose is installed here")
def test_compose_accepts_the_cpu_file():
    result = subprocess.run([*COMPOSE, "-f", COMPOSE_FILE, "config", "-q"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "GRPO_SERVER_API_KEY": "x", SECRET_ENV: WORKER_SECRET}, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(not works("docker", "info"), reason="no Docker engine answers `docker info` here")
def test_compose_check_builds_runs_and_recovers_the_cpu_stack():
    """Build, up, a version pushed and served, a sampler crash and a front-end restart survived, down."""
    check = subprocess.Popen([str(REPO / "scripts" / "compose-check")], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = check.communicate(timeout=3400)
    except subprocess.TimeoutExpired:
        check.terminate()  # SIGTERM: the check takes its stack down before it exits (SIGKILL would not)
        output, _ = check.communicate(timeout=180)
    print(output[-4000:])
    assert check.returncode == 0, output[-4000:]
    assert "compose-check: passed" in output
