"""The Helm chart and the compose files, hardened (issue 57): the image's non-root user owns what it writes, every
pod and compose service runs as it with a read-only root, memory limits per role, a liveness probe that a short
stall does not trip, a pinned image, secrets never generated at render time, and NetworkPolicies that limit egress
too. Rendered and validated as tests/test_helm_chart.py does (its helpers)."""

from __future__ import annotations

import base64
import re
from ipaddress import ip_address, ip_network

import helm_python as helm
import pytest
import yaml

from tests.test_helm_chart import (API_KEY_ENV, CACHE_ENV, CHART, DOCKERFILE, LAYOUT_FILES, NAMESPACE, RELEASE, REPO,
                                   SECRET_ENV, SECRETS, compose_services, compose_writable, container,
                                   dockerfile_env, dockerfile_user, env_names, layout, one, pod_writable, render,
                                   stall_tolerated, under)

# --- hardened: the user, the filesystem, memory, probes, the image --------------------------------------

def test_the_image_runs_as_a_non_root_user_that_owns_what_it_writes():
    uid, gid = dockerfile_user().split(":")
    assert uid.isdigit() and gid.isdigit() and int(uid) > 0 and int(gid) > 0, dockerfile_user()  # numeric: runAsNonRoot checks it
    # The last instruction that changes the user comes after every RUN: nothing later runs as root by accident.
    instructions = re.findall(r"^(RUN|USER|CMD|ENTRYPOINT)\b", DOCKERFILE, re.M)
    assert instructions.index("USER") > max(i for i, kind in enumerate(instructions) if kind == "RUN")
    home = re.search(rf"useradd --uid {uid} --gid {gid} --home-dir (\S+)", DOCKERFILE)
    assert home and re.search(rf"groupadd --gid {gid} ", DOCKERFILE), "the Dockerfile makes no user with those ids"
    env = dockerfile_env()
    assert env["HOME"] == home.group(1)
    for name in CACHE_ENV:
        assert under(env[name], [env["HOME"]]), name  # every cache the processes fill, in the user's HOME
    # The user owns the run directory and HOME (named volumes start with the image's owner); the code and the
    # prepared model stay root's.
    owned = re.search(r"chown -R (\d+):(\d+) (.+)$", DOCKERFILE, re.M)
    assert owned and f"{owned.group(1)}:{owned.group(2)}" == dockerfile_user()
    assert {"/runs", env["HOME"]} <= set(owned.group(3).split())
    assert not under(env["GRPO_SERVER_CACHE"], owned.group(3).split() + ["/tmp"])
    # ... but readable by the user: the prepared model's weights file is written 0600 (seen: PermissionError).
    assert re.search(r"grpo-server model prepare && chmod -R a\+rX \"\$GRPO_SERVER_CACHE\"", DOCKERFILE)


@pytest.mark.parametrize("name", LAYOUT_FILES)
def test_every_pod_runs_as_the_images_user_read_only(chart, name):
    objects = render(chart, layout(name))
    uid, gid = map(int, dockerfile_user().split(":"))
    home = dockerfile_env()["HOME"]
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    assert len(workloads) == 3
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": gid, "fsGroup": gid,
                                          "fsGroupChangePolicy": "OnRootMismatch",
                                          "seccompProfile": {"type": "RuntimeDefault"}}
        c = container(workload)
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
        writable = pod_writable(workload)
        # Every path the image's processes write is on a mount; nothing of the code or the venv is.
        for path in ["/runs", "/tmp", "/dev/shm", *(dockerfile_env()[n] for n in CACHE_ENV)]:
            assert under(path, writable), (workload["metadata"]["name"], path)
        assert not any(under(path, writable) for path in ("/app", "/opt/venv", dockerfile_env()["GRPO_SERVER_CACHE"]))
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        for path in ("/tmp", home):
            assert set(volumes[mounts[path]]) == {"name", "emptyDir"} and volumes[mounts[path]]["emptyDir"]["sizeLimit"]


@pytest.mark.parametrize("compose_file", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_every_compose_service_runs_as_the_images_user_read_only(compose_file):
    env = dockerfile_env()
    services = compose_services(None, {"COMPOSE_PROFILES": "gpus-8"}, compose_file)
    assert len(services) == (9 if compose_file == "docker-compose.yml" else 3)
    for name, service in services.items():
        assert service["user"] == dockerfile_user(), name
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"], name
        assert service["security_opt"] == ["no-new-privileges:true"], name
        writable = compose_writable(service)
        for path in ["/runs", "/tmp", *(env[n] for n in CACHE_ENV)]:
            assert under(path, writable), (name, path)
        assert not under("/app/configs", writable) and not under("/opt/venv", writable), name
        assert f"home:{env['HOME']}" in service["volumes"], name  # a named volume: the caches outlive a restart


def test_compose_publishes_the_front_end_on_loopback_unless_told():
    frontend = compose_services("gpus-2.env")["frontend"]
    assert frontend["ports"] == ["127.0.0.1:8000:8000"]
    assert compose_services("gpus-2.env", {"GRPO_SERVER_BIND": "0.0.0.0", "GRPO_PORT": "9000"})["frontend"][
        "ports"] == ["0.0.0.0:9000:8000"]
    # Only the front end publishes a port; the CPU file publishes none (host network, loopback addresses).
    assert [n for n, s in compose_services("gpus-8.env").items() if "ports" in s] == ["frontend"]
    assert not [n for n, s in compose_services(None, None, "docker-compose.cpu.yml").items() if "ports" in s]


MEBIBYTES = {"Mi": 1, "Gi": 2 ** 10, "Ti": 2 ** 20}


def mebibytes(quantity: str) -> int:
    m = re.fullmatch(r"(\d+)(Mi|Gi|Ti)", quantity)
    assert m, quantity
    return int(m.group(1)) * MEBIBYTES[m.group(2)]


@pytest.mark.parametrize("name", LAYOUT_FILES)
def test_every_role_has_a_memory_request_and_limit(chart, name):
    objects = render(chart, layout(name))
    shm = mebibytes(yaml.safe_load((CHART / "values.yaml").read_text())["shm"]["sizeLimit"])
    limits = {}
    for workload in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
        role = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        resources = container(workload)["resources"]
        request, limit = mebibytes(resources["requests"]["memory"]), mebibytes(resources["limits"]["memory"])
        assert request <= limit, role
        assert "cpu" in resources["requests"] and "cpu" not in resources.get("limits", {}), role  # no CPU throttling
        limits[role] = limit
    # /dev/shm (memory) fits beside the GPU pods' own use; the front end, which holds no weights, needs least.
    assert sorted(limits) == ["frontend", "learner", "sampler"]
    assert limits["frontend"] < limits["sampler"] <= limits["learner"] and limits["sampler"] > shm


@pytest.mark.parametrize("name", LAYOUT_FILES)
def test_liveness_tolerates_a_short_stall_and_readiness_is_separate(chart, name):
    objects = render(chart, layout(name))
    for workload in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
        c = container(workload)
        liveness, readiness = c["livenessProbe"], c["readinessProbe"]
        assert stall_tolerated(liveness) >= 60, (workload["metadata"]["name"], liveness)  # a 60 s stall: no restart
        assert liveness != readiness and stall_tolerated(readiness) < stall_tolerated(liveness)
        assert liveness["timeoutSeconds"] >= 10  # one slow answer is not a failure
        # The startup probe covers the model's load; liveness starts only after it.
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 900


def test_the_image_is_pinned(chart):
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    # The default tag: the chart's appVersion, the package's version (what the Dockerfile builds from this tree).
    assert re.search(rf'^version = "{re.escape(app_version)}"$', (REPO / "pyproject.toml").read_text(), re.M)
    digest = "sha256:" + "ab" * 32
    for values, expected in (({}, f"grpo-server:{app_version}"),
                             ({"image": {"repository": "registry.example.com/grpo-server", "tag": "0.2.0"}},
                              "registry.example.com/grpo-server:0.2.0"),
                             ({"image": {"repository": "registry.example.com:5000/grpo-server", "digest": digest}},
                              f"registry.example.com:5000/grpo-server@{digest}")):
        objects = render(chart, values)
        images = {container(o)["image"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
        assert images == {expected}, values


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
    # Never made up: the same values render the same Secret every time, and no template draws random bytes.
    assert one(render(chart, None), "Secret", secret["metadata"]["name"]) == \
        one(render(chart, None), "Secret", secret["metadata"]["name"])
    templates = "\n".join(p.read_text() for p in (CHART / "templates").iterdir())
    assert not re.search(r"\b(rand\w*|uuidv4|genPrivateKey|genCA|now)\b", templates)
    # Not given (nor an existing Secret): refused at install, naming the value to give.
    for missing in ("apiKey", "workerSecret"):
        given = {k: v for k, v in SECRETS["secrets"].items() if k != missing}
        with pytest.raises(helm.HelmRenderError, match=f"secrets.{missing} is required"):
            render(chart, {"secrets": given})
    # A Secret of one's own: none rendered, every reference names it.
    objects = render(chart, {"secrets": {"existingSecret": "mine"}})
    assert not [o for o in objects if o["kind"] == "Secret"]
    refs = re.findall(r"secretKeyRef:\n\s+key: [\w-]+\n\s+name: ([\w-]+)", everything_but_secrets(objects))
    assert refs and set(refs) == {"mine"}


def endpoint(labels: dict[str, str], namespace: str = NAMESPACE) -> dict:
    return {"namespace": namespace, "namespace_labels": {"kubernetes.io/metadata.name": namespace}, "labels": labels}


def selects(selector: dict, labels: dict) -> bool:
    assert "matchExpressions" not in selector, selector  # not evaluated here
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def peer_matches(peer: dict, other: dict) -> bool:
    """Whether a NetworkPolicy peer (of a policy in NAMESPACE) is the endpoint `other`."""
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        return "ip" in other and ip_address(other["ip"]) in ip_network(block["cidr"]) and not any(
            ip_address(other["ip"]) in ip_network(e) for e in block.get("except", []))
    if "ip" in other:
        return False  # outside the cluster: only an ipBlock names it
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], other["namespace_labels"]):
            return False
    elif other["namespace"] != NAMESPACE:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], other["labels"])


def direction_allows(policies: list[dict], subject: dict, other: dict, port: int, protocol: str, kind: str) -> bool:
    """Whether the policies selecting `subject` let it talk to `other` (kind Egress) or hear it (Ingress); a pod
    that no policy of that kind selects, or an endpoint outside the cluster, takes anything."""
    if "ip" in subject:
        return True
    applying = [p for p in policies if subject["namespace"] == NAMESPACE and selects(p["spec"]["podSelector"], subject[
        "labels"]) and kind in p["spec"].get("policyTypes", ["Ingress"])]
    if not applying:
        return True
    rules_key, peers_key = ("egress", "to") if kind == "Egress" else ("ingress", "from")
    for policy in applying:
        for rule in policy["spec"].get(rules_key, []):
            ports = rule.get("ports")
            port_ok = not ports or any(p.get("port") in (None, port) and p.get("protocol", "TCP") == protocol
                                       for p in ports)
            peers = rule.get(peers_key)
            if port_ok and (not peers or any(peer_matches(peer, other) for peer in peers)):
                return True
    return False


def allowed(policies: list[dict], source: dict, target: dict, port: int, protocol: str = "TCP") -> bool:
    """Whether NetworkPolicy lets `source` open a connection to `target` on `port`: the source's egress and the
    target's ingress both."""
    return (direction_allows(policies, source, target, port, protocol, "Egress")
            and direction_allows(policies, target, source, port, protocol, "Ingress"))


ROLE_ENDPOINTS = {role: endpoint({"app.kubernetes.io/name": "grpo-server", "app.kubernetes.io/instance": RELEASE,
                                  "app.kubernetes.io/component": role}) for role in ("frontend", "sampler", "learner")}
ENDPOINTS = {**ROLE_ENDPOINTS,
             "client": endpoint({"app": "anything-else"}),
             "dns": endpoint({"k8s-app": "kube-dns"}, "kube-system"),
             "not-dns": endpoint({"k8s-app": "kube-dns"}),  # a pod with DNS's label in the release's namespace
             "internet": {"ip": "203.0.113.7"}}


@pytest.mark.parametrize("name", LAYOUT_FILES)
def test_only_the_front_end_reaches_the_workers_and_egress_is_limited(chart, name):
    objects = render(chart, layout(name))
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    two_nodes = layout(name)["learner"]["nodes"] > 1
    expected = {  # (from, to, port[, protocol]): allowed
        ("client", "frontend", 8000): True,
        ("client", "sampler", 8101): False, ("client", "learner", 8102): False,
        ("frontend", "sampler", 8101): True, ("frontend", "learner", 8102): True,
        ("sampler", "learner", 8102): True,  # a sampler fetches adapter files from the learner
        ("learner", "sampler", 8101): False, ("sampler", "sampler", 8101): False,
        ("client", "learner", 29500): False,
        ("learner", "learner", 29500): two_nodes,  # torchrun's store (and NCCL) between the learner's pods
        ("client", "frontend", 8101): False,
        # Egress: the cluster's DNS for every role, and nothing the roles do not call.
        ("frontend", "dns", 53, "UDP"): True, ("sampler", "dns", 53, "UDP"): True, ("learner", "dns", 53, "TCP"): True,
        ("frontend", "not-dns", 53, "UDP"): False, ("frontend", "dns", 443): False,
        ("frontend", "internet", 443): False, ("sampler", "internet", 443): False, ("learner", "internet", 443): False,
        ("sampler", "frontend", 8000): False, ("learner", "frontend", 8000): False,  # the workers call no front end
        ("frontend", "client", 8000): False,  # nor does the front end call other pods
        ("internet", "frontend", 8000): True,  # clients from outside (frontendFrom empty: anyone)
    }
    got = {key: allowed(policies, ENDPOINTS[key[0]], ENDPOINTS[key[1]], *key[2:]) for key in expected}
    assert got == expected
    # The trackers' egress, opt-in for the one role that sends it: here HTTPS anywhere for the front end.
    opened = render(chart, {**layout(name), "networkPolicy": {"extraEgress": {"frontend": [
        {"ports": [{"port": 443, "protocol": "TCP"}]}]}}})
    policies = [o for o in opened if o["kind"] == "NetworkPolicy"]
    assert allowed(policies, ENDPOINTS["frontend"], ENDPOINTS["internet"], 443)
    assert not allowed(policies, ENDPOINTS["sampler"], ENDPOINTS["internet"], 443)
    assert not allowed(policies, ENDPOINTS["frontend"], ENDPOINTS["internet"], 80)
    # Off, there is none (whatever the cluster allows then).
    assert not [o for o in render(chart, {**layout(name), "networkPolicy": {"enabled": False}})
                if o["kind"] == "NetworkPolicy"]
