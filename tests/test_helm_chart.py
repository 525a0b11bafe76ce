"""The Helm chart (deploy/helm/grpo-server), offline: Helm v4 itself renders and lints it (helm-python-sdk: Helm's Go
SDK as a library bundled in the wheel; no helm binary, no cluster, no network), every rendered object is checked
against the Kubernetes API's schemas in strict mode (kubernetes-validate, its bundled schemas), the layouts agree
with docker-compose.yml's for the same GPUs (roles, commands, ports, environment, secrets, volumes, probes, GPUs,
the server config), and values that contradict each other are refused with a message that says what to change.
The hardening of the chart, the compose files and the Dockerfile together: one non-root user, read-only root
filesystems with the writable paths the image's caches need, egress limited, memory limits, pinned images, secrets
never made up, a liveness probe that a short stall does not trip; and the deployment guides' commands as written."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import helm_python as helm  # the dev extra's helm-python-sdk (import name helm_python)
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "grpo-server"
LAYOUTS = REPO / "deploy" / "helm" / "layouts"
# The chart's floor (Chart.yaml kubeVersion: the pod-index label) and the newest API the pinned package carries.
K8S_VERSIONS = ("1.28.0", "1.37.0")
RELEASE, NAMESPACE = "grpo", "ml"
SECRET_ENV = "GRPO_SERVER_WORKER_SECRET"  # grpo_server/protocol/worker_auth.py (checked below)
API_KEY_ENV = "GRPO_SERVER_API_KEY"
# Each layout file and what it is: compose's env file for the same GPUs (None: no compose equivalent).
LAYOUT_FILES = {"gpus-2": "gpus-2.env", "gpus-4": "gpus-4.env", "gpus-8": "gpus-8.env", "nodes-2": None}
# The chart makes no secret up: every install gives them (or secrets.existingSecret). render() adds these unless the
# values name `secrets` themselves.
SECRETS = {"secrets": {"apiKey": "admin-key-0123456789-abcdef", "workerSecret": "worker-secret-0123456789-abcdef"}}


def layout(name: str) -> dict:
    return yaml.safe_load((LAYOUTS / f"{name}.yaml").read_text())


def with_secrets(values: dict | None) -> dict:
    return {**SECRETS, **(values or {})}


def render(chart, values: dict | None) -> list[dict]:
    manifests = chart.render(with_secrets(values), name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [obj for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for obj in yaml.safe_load_all(text) if obj]


def one(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def container(workload: dict) -> dict:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def server_config(objects: list[dict]) -> dict:
    return yaml.safe_load(one(objects, "ConfigMap", f"{RELEASE}-grpo-server-config")["data"]["server.yaml"])


def env_names(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


# --- compose, as the tests of the compose file read it ---------------------------------------------------

INTERPOLATION = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def compose_services(env_file: str | None, more_env: dict[str, str] | None = None,
                     compose_file: str = "docker-compose.yml") -> dict[str, dict]:
    """docker-compose.yml's services that run with `--env-file configs/compose/<env_file>` (and `more_env`)."""
    env = dict(line.split("=", 1) for line in (REPO / "configs/compose" / env_file).read_text().splitlines()
               if line.strip() and not line.startswith("#")) if env_file else {}
    env |= {API_KEY_ENV: "admin-key", SECRET_ENV: "worker-secret-0123456789"} | (more_env or {})

    def value(m: re.Match) -> str:
        name, op, arg = m.groups()
        return env.get(name) or (arg if op == "-" else "")
    compose = yaml.safe_load(INTERPOLATION.sub(value, (REPO / compose_file).read_text()))
    profiles = set(filter(None, env.get("COMPOSE_PROFILES", "").split(",")))
    return {name: s for name, s in compose["services"].items()
            if not s.get("profiles") or profiles & set(s["profiles"])}


def compose_writable(service: dict) -> list[str]:
    """Where a compose service may write: its read-write volumes, its tmpfs mounts and /dev/shm (Docker's)."""
    volumes = [v.split(":")[1] for v in service.get("volumes", []) if not v.endswith(":ro")]
    return [*volumes, *(t.split(":")[0] for t in service.get("tmpfs", [])), "/dev/shm"]


def pod_writable(workload: dict) -> list[str]:
    """Where a pod's container may write, its root filesystem being read-only: its read-write mounts."""
    assert container(workload)["securityContext"]["readOnlyRootFilesystem"] is True
    return [m["mountPath"] for m in container(workload)["volumeMounts"] if not m.get("readOnly")]


def under(path: str, folders: list[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def stall_tolerated(probe: dict) -> int:
    """The longest stall a probe never fails for: a probe sent as the stall starts, and failureThreshold - 1 more."""
    return (probe["failureThreshold"] - 1) * probe["periodSeconds"] + probe["timeoutSeconds"]


# --- the image, as the Dockerfile builds it ----------------------------------------------------------------

DOCKERFILE = (REPO / "Dockerfile").read_text()


def dockerfile_env() -> dict[str, str]:
    """The Dockerfile's ENV settings (KEY=value forms, continued lines joined)."""
    env: dict[str, str] = {}
    for block in re.findall(r"^ENV ((?:.*\\\n)*.*)$", DOCKERFILE, re.M):
        env |= dict(pair.split("=", 1) for pair in shlex.split(block.replace("\\\n", " ")))
    return env


def dockerfile_user() -> str:
    users = re.findall(r"^USER (\S+)$", DOCKERFILE, re.M)
    assert users, "the Dockerfile sets no USER: its processes would run as root"
    return users[-1]


# The paths the image's processes write besides /runs, /tmp and /dev/shm: HOME and the caches it points at.
CACHE_ENV = ("HOME", "XDG_CACHE_HOME", "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def seconds(duration: str) -> int:
    """Compose's durations as the file writes them: 10s, 15m."""
    m = re.fullmatch(r"(\d+)(s|m|h)", duration)
    assert m, duration
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def binary_bytes(size: str) -> int:
    """16gb (Docker's shm_size: binary units) or 16Gi (Kubernetes)."""
    m = re.fullmatch(r"(\d+)(gb|g|Gi|mb|m|Mi)", size)
    assert m, size
    return int(m.group(1)) * 2 ** (30 if m.group(2)[0] in "gG" else 20)


# --- the chart renders, lints and validates ----------------------------------------------------------------

def test_every_layout_file_is_tested_and_names_its_own_layout():
    assert sorted(p.stem for p in LAYOUTS.glob("*.yaml")) == sorted(LAYOUT_FILES)
    for name in LAYOUT_FILES:
        values = layout(name)
        gpus = values["cluster"]["nodes"] * values["cluster"]["gpusPerNode"]
        assert name == (f"gpus-{gpus}" if values["cluster"]["nodes"] == 1 else f"nodes-{values['cluster']['nodes']}")
        # Every GPU used once: the samplers take what the learner leaves.
        assert values["sampler"]["replicas"] + values["learner"]["nodes"] * values["learner"]["gpusPerNode"] == gpus


def test_the_defaults_are_the_two_gpu_layout(chart):
    assert render(chart, None) == render(chart, layout("gpus-2"))
    assert render(chart, None) != render(chart, layout("gpus-4"))


@pytest.mark.parametrize("name", LAYOUT_FILES)
def test_helm_lints_each_layout_strictly(name):
    for version in K8S_VERSIONS:
        report = helm.lint(CHART, with_secrets(layout(name)), strict=True, kube_version=f"v{version}")
        problems = [m for m in report["messages"] if m["severity"] >= 2]  # 1 is info ("icon is recommended")
        assert report["total_charts_linted"] == 1 and not problems and not report["errors"], report


@pytest.mark.parametrize("name", LAYOUT_FILES)
def test_every_rendered_object_validates_strictly(chart, name):
    objects = render(chart, layout(name))
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["ConfigMap", "Deployment", "NetworkPolicy", "NetworkPolicy", "NetworkPolicy",
                            "PersistentVolumeClaim", "Secret", "Service", "Service", "Service", "StatefulSet",
                            "StatefulSet"])
    for obj in objects:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError
    # The validator is strict: a misspelt field and a mistyped one are refused (so the loop above checks something).
    statefulset = copy.deepcopy(next(o for o in objects if o["kind"] == "StatefulSet"))
    statefulset["spec"]["template"]["spec"]["containers"][0]["comand"] = ["grpo-server"]
    with pytest.raises(kubernetes_validate.ValidationError, match="comand"):
        kubernetes_validate.validate(statefulset, K8S_VERSIONS[0], strict=True)
    service = copy.deepcopy(next(o for o in objects if o["kind"] == "Service"))
    service["spec"]["ports"][0]["port"] = "8000"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, K8S_VERSIONS[0], strict=True)


# --- the chart agrees with compose ------------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n, env in LAYOUT_FILES.items() if env])
def test_the_topology_agrees_with_compose(chart, name):
    services = compose_services(LAYOUT_FILES[name])
    objects = render(chart, layout(name))
    prefix = f"{RELEASE}-grpo-server"
    workloads = {"frontend": one(objects, "Deployment", f"{prefix}-frontend"),
                 "sampler": one(objects, "StatefulSet", f"{prefix}-sampler"),
                 "learner": one(objects, "StatefulSet", f"{prefix}-learner")}
    by_role: dict[str, list[str]] = {}
    for service_name, service in services.items():
        by_role.setdefault(service["command"][service["command"].index("--role") + 1], []).append(service_name)
    # Roles: one front end, one learner, a sampler pod for each compose sampler service.
    assert sorted(by_role) == sorted(workloads)
    assert workloads["frontend"]["spec"]["replicas"] == len(by_role["frontend"]) == 1
    assert workloads["learner"]["spec"]["replicas"] == len(by_role["learner"]) == 1
    assert workloads["sampler"]["spec"]["replicas"] == len(by_role["sampler"])

    for role, workload in workloads.items():
        c = container(workload)
        pod = workload["spec"]["template"]["spec"]
        for service_name in by_role[role]:
            service = services[service_name]
            # The command: the same `grpo-server serve --role ...`, the config file at the chart's path, pod i of
            # the samplers' StatefulSet its --replica i (the pod-index label, through the environment).
            expected = list(service["command"])
            expected[expected.index("--config") + 1] = "/etc/grpo-server/server.yaml"
            command = list(c["command"])
            if role == "sampler":
                assert command[command.index("--replica") + 1] == "$(GRPO_REPLICA)"
                assert env_names(c)["GRPO_REPLICA"]["valueFrom"]["fieldRef"]["fieldPath"] == \
                    "metadata.labels['apps.kubernetes.io/pod-index']"
                command[command.index("--replica") + 1] = service_name.removeprefix("sampler-")
            assert command == expected, service_name
            # Environment and secrets: the same variables, each from the Secret, none with a value of its own.
            env = env_names(c)
            secret_env = {n for n, e in env.items() if "secretKeyRef" in e.get("valueFrom", {})}
            assert secret_env == set(service["environment"]), service_name
            assert all("value" not in env[n] for n in secret_env)
            # The health route and its port: compose's healthcheck's; startup and readiness also its timings
            # (Docker only marks a container unhealthy, as readiness only takes a pod out of its Service).
            # Liveness restarts the container: it waits longer (test_liveness_tolerates_a_short_stall).
            check = service["healthcheck"]
            url = urlsplit(check["test"][-1])
            assert check["test"][:3] == ["CMD", "curl", "-fsS"]
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = c[probe_name]
                assert probe["httpGet"]["path"] == url.path, (service_name, probe_name)
                assert ports[probe["httpGet"]["port"]] == url.port, (service_name, probe_name)
            for probe_name in ("startupProbe", "readinessProbe"):
                assert c[probe_name]["periodSeconds"] == seconds(check["interval"])
                assert c[probe_name]["timeoutSeconds"] == seconds(check["timeout"])
            assert c["readinessProbe"]["failureThreshold"] == check["retries"]
            assert stall_tolerated(c["livenessProbe"]) > stall_tolerated(c["readinessProbe"])
            startup = c["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= seconds(check["start_period"])
            # The same user, and the same hardening: no privilege escalation, no capability, a read-only root
            # filesystem with /tmp and HOME writable (compose: a tmpfs and the volume `home`; here emptyDirs).
            security, pod_security = c["securityContext"], pod["securityContext"]
            assert service["user"] == f"{pod_security['runAsUser']}:{pod_security['runAsGroup']}" == dockerfile_user()
            assert service["read_only"] is security["readOnlyRootFilesystem"] is True
            assert service["cap_drop"] == security["capabilities"]["drop"] == ["ALL"]
            assert "no-new-privileges:true" in service["security_opt"]
            assert security["allowPrivilegeEscalation"] is False
            # The port: the one compose's worker listens on (its URL in the server config), or the public one.
            assert list(ports.values()) == [url.port]
            # The volume: the run directory at /runs, from the one claim, as compose's `runs:/runs`.
            assert "runs:/runs" in service["volumes"]
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert volumes[mounts["/runs"]]["persistentVolumeClaim"]["claimName"] == f"{prefix}-runs"
            assert sorted(compose_writable(service)) == sorted(pod_writable(workload)), service_name
            shm = volumes[mounts["/dev/shm"]]["emptyDir"]
            assert shm["medium"] == "Memory" and binary_bytes(shm["sizeLimit"]) == binary_bytes(service["shm_size"])
            # GPUs: as many as compose reserves for the service.
            reserved = sum(len(d["device_ids"]) for d in
                           service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", []))
            assert c["resources"].get("limits", {}).get("nvidia.com/gpu", 0) == reserved, service_name
            # No service link variables (GRPO_SERVER_PORT=tcp://... from a Service named grpo-server would be
            # read as the config's `port`).
            assert pod["enableServiceLinks"] is False

    # The front end's Service: its port only; the workers' names come from headless Services.
    service = one(objects, "Service", prefix)
    assert [p["port"] for p in service["spec"]["ports"]] == [8000] and service["spec"].get("clusterIP") != "None"
    for role in ("sampler", "learner"):
        headless = one(objects, "Service", f"{prefix}-{role}")
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
        assert workloads[role]["spec"]["serviceName"] == headless["metadata"]["name"]


@pytest.mark.parametrize("name", [n for n, env in LAYOUT_FILES.items() if env])
def test_the_server_config_is_composes_with_the_pods_names(chart, name):
    """configs/compose/gpus-N.yaml and the chart's server.yaml: the same settings; the workers' URLs name the
    StatefulSets' pods (<pod>.<headless service>.<namespace>.svc.cluster.local) on compose's ports."""
    compose_config = yaml.safe_load((REPO / "configs/compose" / f"{name}.yaml").read_text())
    config = server_config(render(chart, layout(name)))
    prefix = f"{RELEASE}-grpo-server"
    pod = "{prefix}-{role}-{i}.{prefix}-{role}.{ns}.svc.cluster.local"
    compose_urls = [urlsplit(u) for u in compose_config["sampler"].pop("urls")]
    assert config["sampler"].pop("urls") == [
        f"http://{pod.format(prefix=prefix, role='sampler', i=i, ns=NAMESPACE)}:{u.port}"
        for i, u in enumerate(compose_urls)]
    compose_learner = urlsplit(compose_config["learner"].pop("url"))
    assert config["learner"].pop("url") == \
        f"http://{pod.format(prefix=prefix, role='learner', i=0, ns=NAMESPACE)}:{compose_learner.port}"
    assert config == compose_config


@pytest.mark.parametrize("name", LAYOUT_FILES)
def test_the_server_config_fits_every_role(chart, name, monkeypatch, tmp_path):
    """The rendered server.yaml through the server's own loader and role checks, as each pod runs it."""
    from grpo_server.config import load_server_config
    from grpo_server.protocol import worker_auth
    from grpo_server.serve import RoleError, check_role

    assert worker_auth.SECRET_ENV == SECRET_ENV
    objects = render(chart, layout(name))
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(server_config(objects)))
    monkeypatch.setenv(SECRET_ENV, "w" * 32)  # from the Secret, as every pod gets it
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = load_server_config(path)
    replicas = layout(name)["sampler"]["replicas"]
    check_role(config, "frontend", None)
    check_role(config, "learner", None)
    for replica in range(replicas):
        check_role(config, "sampler", replica)
    with pytest.raises(RoleError, match=f"--replica {replicas}"):
        check_role(config, "sampler", replicas)  # one pod more than the URLs: refused, so the counts agree
    assert config.learner.ranks == (layout(name)["learner"]["gpusPerNode"] if layout(name)["learner"]["nodes"] == 1
                                    else 1)


# --- the two-node layout: the learner as a torchrun job ---------------------------------------------------

def test_two_nodes_run_the_learner_as_torchrun_across_nodes(chart):
    values = layout("nodes-2")
    objects = render(chart, values)
    prefix = f"{RELEASE}-grpo-server"
    learner = one(objects, "StatefulSet", f"{prefix}-learner")
    c = container(learner)
    command = c["command"]
    # The flags docs/multi-host.md's torchrun job takes, with the node rank from the pod's index.
    docs = (REPO / "docs" / "multi-host.md").read_text()
    docs_flags = set(re.findall(r"--(?:nnodes|node-rank|nproc-per-node|master-addr|master-port)", docs))
    assert docs_flags <= set(command)
    assert command[0] == "torchrun" and command[command.index("-m") + 1:command.index("-m") + 5] == \
        ["grpo_server.cli", "serve", "--role", "learner"]
    flag = lambda f: command[command.index(f) + 1]  # noqa: E731
    assert flag("--nnodes") == str(values["learner"]["nodes"]) == str(learner["spec"]["replicas"])
    assert flag("--nproc-per-node") == str(values["learner"]["gpusPerNode"])
    assert flag("--node-rank") == "$(GRPO_NODE_RANK)"
    assert env_names(c)["GRPO_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    config = server_config(objects)
    assert urlsplit(config["learner"]["url"]).hostname == flag("--master-addr")  # pod 0: node rank 0, rank 0
    assert "ranks" not in config["learner"]  # WORLD_SIZE sets it under torchrun
    assert c["resources"]["limits"]["nvidia.com/gpu"] == values["learner"]["gpusPerNode"]
    # All nodes start at once, one learner pod per node; samplers spread over the nodes.
    assert learner["spec"]["podManagementPolicy"] == "Parallel"
    affinity = learner["spec"]["template"]["spec"]["affinity"]
    anti = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    sampler = one(objects, "StatefulSet", f"{prefix}-sampler")
    assert sampler["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["maxSkew"] == 1
    assert len(config["sampler"]["urls"]) == sampler["spec"]["replicas"] == values["sampler"]["replicas"]
    # The rendezvous port on pod 0's stable name; only node 0 serves the verbs, so the probes skip the others.
    headless = one(objects, "Service", f"{prefix}-learner")
    assert {p["port"] for p in headless["spec"]["ports"]} == {8102, int(flag("--master-port"))}
    probe = c["livenessProbe"]["exec"]["command"]
    assert probe[:2] == ["sh", "-c"] and "GRPO_NODE_RANK" in probe[2] and "http://127.0.0.1:8102/health" in probe[2]
    # Pods on two nodes share the run directory: a ReadWriteMany claim.
    assert one(objects, "PersistentVolumeClaim", f"{prefix}-runs")["spec"]["accessModes"] == ["ReadWriteMany"]


def pod_template(objects: list[dict], kind: str, role: str) -> dict:
    return one(objects, kind, f"{RELEASE}-grpo-server-{role}")["spec"]["template"]


def test_scaling_the_samplers_restarts_the_front_end_and_no_worker(chart):
    """More samplers: new pods and a new URL list, which only the front end reads; so its pod template changes
    (the config's checksum: it restarts and connects to every sampler) and the running workers' do not."""
    before, after = render(chart, layout("gpus-4")), render(chart, layout("gpus-8"))
    assert len(server_config(after)["sampler"]["urls"]) == 7
    assert pod_template(before, "Deployment", "frontend") != pod_template(after, "Deployment", "frontend")
    for role in ("sampler", "learner"):
        assert pod_template(before, "StatefulSet", role) == pod_template(after, "StatefulSet", role), role
    # Any other change to the config rolls every pod.
    changed = render(chart, {**layout("gpus-4"), "config": {**yaml.safe_load((CHART / "values.yaml").read_text())[
        "config"], "max_model_len": 4096}})
    for kind, role in (("Deployment", "frontend"), ("StatefulSet", "sampler"), ("StatefulSet", "learner")):
        assert pod_template(before, kind, role) != pod_template(changed, kind, role), role


# --- the deployment guides' commands, as written ----------------------------------------------------------

def bash_blocks(page: str) -> list[list[str]]:
    """Each ```bash block of a docs page as its commands: continued lines joined, comment lines dropped."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (REPO / "docs" / page).read_text(), re.M | re.S)
    commands = []
    for block in blocks:
        lines = [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
        commands.append([line for line in lines if not line.lstrip().startswith("#")])
    return commands


def uncommented(command: str) -> str:
    return re.sub(r"\s+#.*$", "", command).strip()


@pytest.mark.parametrize("compose_file", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_the_compose_guide_sets_what_compose_requires(compose_file):
    """Every `up` in docs/deployment/compose.md comes after every variable the file requires (`${VAR:?...}`) is set
    in the same block: pasted as written, the commands start the stack."""
    required = set(re.findall(r"\$\{(\w+):\?", (REPO / compose_file).read_text()))
    assert {API_KEY_ENV, SECRET_ENV} <= required
    ups = 0
    for commands in bash_blocks("deployment/compose.md"):
        for i, command in enumerate(commands):
            words = shlex.split(uncommented(command))
            is_up = "up" in words and (words[:2] == ["docker", "compose"] or words[:1] == ["docker-compose"])
            if not is_up or ("docker-compose.cpu.yml" in words) != (compose_file == "docker-compose.cpu.yml"):
                continue
            ups += 1
            set_before = set(re.findall(r"(?:^|export\s+|\s)([A-Z][A-Z0-9_]*)=", "\n".join(commands[:i + 1])))
            assert required <= set_before, (command, required - set_before)
    assert ups >= 1, f"docs/deployment/compose.md starts {compose_file} nowhere"


def test_the_one_box_container_is_hardened_as_compose_runs_it():
    runs = [c for commands in bash_blocks("deployment/one-box.md") for c in commands if c.startswith("docker run")]
    assert len(runs) == 1
    words = shlex.split(uncommented(runs[0]))
    flag = lambda f: words[words.index(f) + 1]  # noqa: E731
    frontend = compose_services("gpus-2.env")["frontend"]
    assert flag("--user") == frontend["user"] and "--read-only" in words and flag("--cap-drop") == "ALL"
    assert flag("--security-opt") in frontend["security_opt"] and flag("--tmpfs") in frontend["tmpfs"]
    assert flag("-p") == frontend["ports"][0]  # loopback
    mounts = {w.split(":")[1] for i, w in enumerate(words) if words[i - 1] == "-v"}
    assert mounts == {v.split(":")[1] for v in frontend["volumes"] if not v.endswith(":ro")}


def test_the_multi_host_guide_starts_all_but_the_last_server_in_the_background():
    """A server runs in the foreground until stopped: one pasted after it in the same shell never starts."""
    blocks = bash_blocks("multi-host.md")
    servers = 0
    for commands in blocks:
        for i, command in enumerate(commands):
            command = uncommented(command)
            if re.search(r"\bgrpo-server serve\b|\btorchrun\b", command):
                servers += 1
                assert i == len(commands) - 1 or command.endswith("&"), command
    assert servers >= 6


def test_the_kubernetes_guide_installs_and_scales_as_written(chart):
    commands = [c for block in bash_blocks("deployment/kubernetes.md") for c in block]
    install = [shlex.split(uncommented(c)) for c in commands if c.startswith("helm install")]
    assert len(install) == 1
    install = install[0]
    values: dict = {}

    def set_value(dotted: str, value) -> None:
        node = values
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    def apply(words: list[str]) -> None:
        for i, word in enumerate(words[:-1]):
            if word == "-f":
                for key, value in yaml.safe_load((REPO / words[i + 1]).read_text()).items():
                    values[key] = value
            elif word in ("--set", "--set-string"):
                key, value = words[i + 1].split("=", 1)
                set_value(key, int(value) if word == "--set" and value.isdigit() else value)
    apply(install)
    # The Secret it names is the one the block makes, with the two keys the chart reads.
    created = [shlex.split(uncommented(c)) for c in commands if c.startswith("kubectl") and "generic" in c]
    assert len(created) == 1 and values["secrets"]["existingSecret"] == created[0][created[0].index("generic") + 1]
    assert {w.split("=")[1] for w in created[0] if w.startswith("--from-literal=")} == {"api-key", "worker-secret"}
    objects = render(chart, values)  # as written: values["secrets"] replaces the test's own
    assert not [o for o in objects if o["kind"] == "Secret"]
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    assert {container(o)["image"] for o in workloads} == {"registry.example.com/grpo-server:0.1.0"}
    refs = re.findall(r"secretKeyRef:\n\s+key: [\w-]+\n\s+name: ([\w-]+)", yaml.safe_dump(workloads))
    assert refs and set(refs) == {values["secrets"]["existingSecret"]}
    # The scaling command on top of it (--reuse-values) renders too.
    upgrade = [shlex.split(uncommented(c)) for c in commands if c.startswith("helm upgrade")]
    assert len(upgrade) == 1 and "--reuse-values" in upgrade[0]
    apply(upgrade[0])
    assert len(server_config(render(chart, values))["sampler"]["urls"]) == values["sampler"]["replicas"]


# --- contradictory values are refused ---------------------------------------------------------------------

REFUSED = {
    # values.schema.json: each value on its own, unknown keys, and pods on several nodes on a one-node claim
    "two nodes on a ReadWriteOnce claim": (
        {"cluster": {"nodes": 2, "gpusPerNode": 8}, "sampler": {"replicas": 12},
         "learner": {"nodes": 2, "gpusPerNode": 2}, "runs": {"accessMode": "ReadWriteOnce"}},
        helm.HelmValuesError, "at '/runs/accessMode': value must be 'ReadWriteMany'"),
    "a misspelt key": ({"sampler": {"replica": 2}}, helm.HelmValuesError, "additional properties 'replica'"),
    "no sampler": ({"sampler": {"replicas": 0}}, helm.HelmValuesError, "at '/sampler/replicas': minimum"),
    "a secret in extraEnv": ({"extraEnv": [{"name": SECRET_ENV, "value": "x" * 20}]}, helm.HelmValuesError,
                             "at '/extraEnv/0/name'"),
    # templates/validate.yaml: what only adds up across values
    "more samplers than GPUs": (
        {"sampler": {"replicas": 2}}, helm.HelmRenderError,
        "sampler.replicas 2 (one GPU each) + the learner's 1 GPU(s) (learner.nodes 1 x learner.gpusPerNode 1) = 3 "
        "GPUs, but cluster.nodes 1 x cluster.gpusPerNode 2 = 2"),
    "8 GPUs, 8 samplers": ({"cluster": {"nodes": 1, "gpusPerNode": 8}, "sampler": {"replicas": 8}},
                           helm.HelmRenderError, "= 9 GPUs, but cluster.nodes 1 x cluster.gpusPerNode 8 = 8"),
    "a learner on more nodes than the cluster": (
        {"cluster": {"nodes": 1, "gpusPerNode": 8}, "sampler": {"replicas": 1}, "learner": {"nodes": 2}},
        helm.HelmRenderError, "learner.nodes 2: each learner pod is a torchrun node on a node of its own"),
    "samplers that crowd out a learner pod": (  # 11 GPUs of 12, but 3 samplers + a 2-GPU learner pod on a node
        {"cluster": {"nodes": 3, "gpusPerNode": 4}, "sampler": {"replicas": 7},
         "learner": {"nodes": 2, "gpusPerNode": 2}}, helm.HelmRenderError,
        "sampler.replicas 7 spread evenly over cluster.nodes 3 puts up to 3 on a node, but a node keeps 2 GPU(s) "
        "beside a learner pod"),
    "sampler URLs in the config": ({"config": {"sampler": {"urls": ["http://x:8101"]}}}, helm.HelmRenderError,
                                   "config.sampler.urls is set by the chart"),
    "the learner's devices in the config": ({"config": {"learner": {"devices": "0,1"}}}, helm.HelmRenderError,
                                            "config.learner.devices is set by the chart"),
    "the worker secret in the config": ({"config": {"worker_secret": "x" * 32}}, helm.HelmRenderError,
                                        "config.worker_secret is set by the chart or comes from the Secret"),
    "a short worker secret": ({"secrets": {"workerSecret": "short"}}, helm.HelmRenderError,
                              "secrets.workerSecret must be at least 16 characters (it has 5)"),
    "an existing Secret and values": ({"secrets": {"existingSecret": "mine", "apiKey": "a" * 20}},
                                      helm.HelmRenderError, "leave secrets.apiKey and secrets.workerSecret empty"),
    "no admin key": ({"secrets": {"workerSecret": "w" * 20}}, helm.HelmRenderError,
                     "secrets.apiKey is required: the admin key, 16 characters or more"),
    "no worker secret": ({"secrets": {"apiKey": "a" * 20}}, helm.HelmRenderError,
                         "secrets.workerSecret is required: the secret the front end and the workers share"),
    "a short admin key": ({"secrets": {"apiKey": "short", "workerSecret": "w" * 20}}, helm.HelmRenderError,
                          "secrets.apiKey must be at least 16 characters (it has 5)"),
    # Hardening: the user, privileges, the image's pin, memory, the liveness probe
    "root": ({"podSecurityContext": {"runAsNonRoot": False}}, helm.HelmValuesError,
             "at '/podSecurityContext/runAsNonRoot': value must be true"),
    "uid 0": ({"podSecurityContext": {"runAsUser": 0}}, helm.HelmValuesError, "at '/podSecurityContext/runAsUser'"),
    "privilege escalation": ({"securityContext": {"allowPrivilegeEscalation": True}}, helm.HelmValuesError,
                             "at '/securityContext/allowPrivilegeEscalation': value must be false"),
    "capabilities kept": ({"securityContext": {"capabilities": {"drop": ["NET_RAW"]}}}, helm.HelmValuesError,
                          "at '/securityContext/capabilities/drop'"),
    "an image tagged latest": ({"image": {"repository": "grpo-server", "tag": "latest"}}, helm.HelmRenderError,
                               "image.tag latest is not a pinned image"),
    "a tag in the repository": ({"image": {"repository": "registry.example.com:5000/grpo-server:latest"}},
                                helm.HelmValuesError, "at '/image/repository'"),
    "a digest that is none": ({"image": {"digest": "sha256:abc"}}, helm.HelmValuesError, "at '/image/digest'"),
    "no memory limit": ({"sampler": {"resources": {"limits": {"memory": None}}}}, helm.HelmValuesError,
                        "at '/sampler/resources/limits': missing property 'memory'"),
    "a memory quantity in bytes": ({"frontend": {"resources": {"limits": {"memory": "8000000000"}}}},
                                   helm.HelmValuesError, "at '/frontend/resources/limits/memory'"),
    "a memory limit under the request": ({"learner": {"resources": {"limits": {"memory": "32Gi"}}}},
                                         helm.HelmRenderError,
                                         "learner.resources.limits.memory 32Gi is below learner.resources.requests."
                                         "memory 64Gi"),
    "a sampler's limit that /dev/shm fills": (
        {"sampler": {"resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "16Gi"}}}},
        helm.HelmRenderError, "sampler.resources.limits.memory 16Gi must be above shm.sizeLimit 16Gi"),
    "a liveness probe a short stall trips": (
        {"probes": {"liveness": {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3}}},
        helm.HelmRenderError, "probes.liveness tolerates 25 s without an answer"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_contradictory_values_are_refused_with_a_clear_message(chart, case):
    values, error, message = REFUSED[case]
    with pytest.raises(error) as refused:
        render(chart, values)
    assert message in str(refused.value)
    # `helm lint` refuses what the schema refuses; a template's `fail` only logs in lint mode (Helm's engine),
    # so those layouts are refused by `helm install` / `upgrade` / `template`, as above.
    report = helm.lint(CHART, values, strict=True)
    if error is helm.HelmValuesError:
        assert report["errors"] and any(message in e for e in report["errors"]), report
