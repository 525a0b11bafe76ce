"""The Helm chart (deploy/helm/grpo-server), offline: Helm v4 itself renders and lints it (helm-python-sdk: Helm's Go
SDK as a library bundled in the wheel; no helm binary, no cluster, no network), every rendered object is checked
against the Kubernetes API's schemas in strict mode (kubernetes-validate, its bundled schemas), the layouts agree
with docker-compose.yml's for the same GPUs (roles, commands, ports, environment, secrets, volumes, probes, GPUs,
the server config), and values that contradict each other are refused with a message that says what to change."""

from __future__ import annotations

import base64
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


def layout(name: str) -> dict:
    return yaml.safe_load((LAYOUTS / f"{name}.yaml").read_text())


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart, values: dict | None) -> list[dict]:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
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


def compose_services(env_file: str) -> dict[str, dict]:
    """docker-compose.yml's services that run with `--env-file configs/compose/<env_file>`."""
    env = dict(line.split("=", 1) for line in (REPO / "configs/compose" / env_file).read_text().splitlines()
               if line.strip() and not line.startswith("#"))
    env |= {API_KEY_ENV: "admin-key", SECRET_ENV: "worker-secret-0123456789"}

    def value(m: re.Match) -> str:
        name, op, arg = m.groups()
        return env.get(name) or (arg if op == "-" else "")
    compose = yaml.safe_load(INTERPOLATION.sub(value, (REPO / "docker-compose.yml").read_text()))
    profiles = set(filter(None, env.get("COMPOSE_PROFILES", "").split(",")))
    return {name: s for name, s in compose["services"].items()
            if not s.get("profiles") or profiles & set(s["profiles"])}


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
    secrets = {"secrets": {"apiKey": "a" * 20, "workerSecret": "w" * 20}}  # else each render makes new ones
    assert render(chart, secrets) == render(chart, {**layout("gpus-2"), **secrets})
    assert render(chart, secrets) != render(chart, {**layout("gpus-4"), **secrets})


@pytest.mark.parametrize("name", LAYOUT_FILES)
def test_helm_lints_each_layout_strictly(name):
    for version in K8S_VERSIONS:
        report = helm.lint(CHART, layout(name), strict=True, kube_version=f"v{version}")
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
            # The health route, its port and timings: compose's healthcheck.
            check = service["healthcheck"]
            url = urlsplit(check["test"][-1])
            assert check["test"][:3] == ["CMD", "curl", "-fsS"]
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = c[probe_name]
                assert probe["httpGet"]["path"] == url.path, (service_name, probe_name)
                assert ports[probe["httpGet"]["port"]] == url.port, (service_name, probe_name)
                assert probe["periodSeconds"] == seconds(check["interval"])
                assert probe["timeoutSeconds"] == seconds(check["timeout"])
            assert c["livenessProbe"]["failureThreshold"] == c["readinessProbe"]["failureThreshold"] == check["retries"]
            startup = c["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= seconds(check["start_period"])
            # The port: the one compose's worker listens on (its URL in the server config), or the public one.
            assert list(ports.values()) == [url.port]
            # The volume: the run directory at /runs, from the one claim, as compose's `runs:/runs`.
            assert "runs:/runs" in service["volumes"]
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert volumes[mounts["/runs"]]["persistentVolumeClaim"]["claimName"] == f"{prefix}-runs"
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


# --- secrets and the network ----------------------------------------------------------------------------

def everything_but_secrets(objects: list[dict]) -> str:
    return yaml.safe_dump([o for o in objects if o["kind"] != "Secret"])


def test_the_secrets_are_only_in_the_secret_and_the_environment(chart):
    api_key, worker_secret = "admin-key-0123456789-abcdef", "worker-secret-0123456789-abcdef"
    objects = render(chart, {"secrets": {"apiKey": api_key, "workerSecret": worker_secret}})
    secret = one(objects, "Secret", f"{RELEASE}-grpo-server-secrets")
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == \
        {"api-key": api_key, "worker-secret": worker_secret}
    rest = everything_but_secrets(objects)
    assert api_key not in rest and worker_secret not in rest
    for workload in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
        c = container(workload)
        assert not any(SECRET_ENV in arg or "secret" in arg.lower() for arg in c["command"])
        assert env_names(c)[SECRET_ENV]["valueFrom"]["secretKeyRef"] == \
            {"name": secret["metadata"]["name"], "key": "worker-secret"}
        assert (API_KEY_ENV in env_names(c)) == (workload["kind"] == "Deployment")  # the admin key: front end only
    # Not given: made at install (the release's own Secret keeps them on upgrade), long enough for the workers.
    made = one(render(chart, None), "Secret", f"{RELEASE}-grpo-server-secrets")["data"]
    assert all(len(base64.b64decode(v)) >= 16 for v in made.values()) and len(set(made.values())) == 2
    # A Secret of one's own: none rendered, every reference names it.
    objects = render(chart, {"secrets": {"existingSecret": "mine"}})
    assert not [o for o in objects if o["kind"] == "Secret"]
    refs = re.findall(r"secretKeyRef:\n\s+key: [\w-]+\n\s+name: ([\w-]+)", everything_but_secrets(objects))
    assert refs and set(refs) == {"mine"}


def allowed(policies: list[dict], source: dict[str, str], target: dict[str, str], port: int) -> bool:
    """Whether NetworkPolicy lets a pod labelled `source` reach a pod labelled `target` on `port` (ingress; a pod
    that no policy selects takes anything)."""
    def selects(selector: dict, labels: dict) -> bool:
        return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    applying = [p for p in policies if selects(p["spec"]["podSelector"], target)]
    if not applying:
        return True
    for policy in applying:
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            peers = rule.get("from")
            if (not ports or port in ports) and (peers is None or any(
                    "podSelector" in peer and selects(peer["podSelector"], source) for peer in peers)):
                return True
    return False


@pytest.mark.parametrize("name", LAYOUT_FILES)
def test_only_the_front_end_reaches_the_workers(chart, name):
    objects = render(chart, layout(name))
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    labels = {role: {"app.kubernetes.io/name": "grpo-server", "app.kubernetes.io/instance": RELEASE,
                     "app.kubernetes.io/component": role} for role in ("frontend", "sampler", "learner")}
    labels["client"] = {"app": "anything-else"}
    two_nodes = layout(name)["learner"]["nodes"] > 1
    expected = {  # (from, to, port): allowed
        ("client", "frontend", 8000): True,
        ("client", "sampler", 8101): False, ("client", "learner", 8102): False,
        ("frontend", "sampler", 8101): True, ("frontend", "learner", 8102): True,
        ("sampler", "learner", 8102): True,  # a sampler fetches adapter files from the learner
        ("learner", "sampler", 8101): False, ("sampler", "sampler", 8101): False,
        ("client", "learner", 29500): False,
        ("learner", "learner", 29500): two_nodes,  # torchrun's store (and NCCL) between the learner's pods
        ("client", "frontend", 8101): False,
    }
    got = {key: allowed(policies, labels[key[0]], labels[key[1]], key[2]) for key in expected}
    assert got == expected
    # Off, there is none (whatever the cluster allows then).
    assert not [o for o in render(chart, {**layout(name), "networkPolicy": {"enabled": False}})
                if o["kind"] == "NetworkPolicy"]


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
