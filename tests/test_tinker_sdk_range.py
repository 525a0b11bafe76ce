"""The supported range of tinker SDK releases (grpo_server/api/tinker/data.py SDK_RELEASES_TESTED), on the shared
real server: the SDK's documented loop (tests/tinker_sdk_loop.py) run by each release in a venv of its own
(tests/tinker_sdk_env.py), the range in the capabilities answer and in the guide, and the REST calls added for
self-hosting (save_weights_external to the server's disk, the listing of every checkpoint; signed URLs refused).

CI time: each release costs 5-12 s of loop on the 2-core box, plus 2-10 s to install it the first time (then
cached under runs/tinker-sdk/). The default suite runs the range's two ends, the floor and the release
constraints.txt pins; GRPO_TINKER_SDK_RANGE=all (scripts/test-tinker-range) runs every release in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from grpo_server.api.tinker.data import SDK_RELEASES_TESTED  # noqa: E402
from tests.serving import ADMIN_KEY  # noqa: E402
from tests.tinker_sdk_env import OVERLAYS, pinned_release, sdk_python  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOOP = ROOT / "tests" / "tinker_sdk_loop.py"
LOOP_TIMEOUT_S = 300
KEY = f"tml-{ADMIN_KEY}"
RANK = 8
# Every release in the range with GRPO_TINKER_SDK_RANGE=all; else its two ends (the module's docstring: CI time).
RANGE = SDK_RELEASES_TESTED if os.environ.get("GRPO_TINKER_SDK_RANGE") == "all" \
    else (SDK_RELEASES_TESTED[0], SDK_RELEASES_TESTED[-1])

os.environ.setdefault("TINKER_TELEMETRY", "0")


def _admin(server, method: str, path: str) -> tuple[int, dict]:
    request = urllib.request.Request(server.url + path, method=method, headers={
        "Authorization": f"Bearer {ADMIN_KEY}", "X-API-Key": KEY})
    with urllib.request.urlopen(request, timeout=300) as response:
        body = response.read()
        return response.status, json.loads(body) if body else {}


def _tinker_experiments(server) -> set[str]:
    return {e["name"] for e in _admin(server, "GET", "/v1/experiments")[1]["experiments"]
            if e["name"].startswith("tinker-")}


@pytest.fixture
def fresh_experiments(server):
    """The shared server's later tests count its experiments: the Tinker models a test made go after it."""
    before = _tinker_experiments(server)
    yield
    for name in sorted(_tinker_experiments(server) - before):
        assert _admin(server, "DELETE", f"/v1/experiments/{name}")[0] == 204


@pytest.mark.parametrize("version", RANGE)
def test_documented_loop_runs_with_each_supported_release(server, tiny_model_dir, fresh_experiments, version):
    python = sdk_python(version)
    run = subprocess.run([str(python), str(LOOP), server.url, KEY, str(tiny_model_dir)], capture_output=True,
                         text=True, timeout=LOOP_TIMEOUT_S, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, f"tinker {version}:\n{run.stderr[-4000:]}"
    report = json.loads(run.stdout.split("RESULT ", 1)[1])
    # The release asked for ran, from its own venv (an overlay that fell through to .venv's tinker would not).
    assert report["version"] == version
    home = Path(report["module"]).resolve()
    assert home.is_relative_to((OVERLAYS / version).resolve()) if version != pinned_release() \
        else not home.is_relative_to(OVERLAYS.resolve()), home
    assert report["loss_after"] < report["loss_before"], report
    assert report["loss_loaded"] == pytest.approx(report["loss_after"], rel=1e-4), report
    assert all(report["sampled"]) and report["checkpoints"] == ["weights/loop"], report


def test_capabilities_and_guide_state_the_range(server):
    status, answer = _admin(server, "GET", "/api/v1/get_server_capabilities")
    assert status == 200
    tested = list(SDK_RELEASES_TESTED)
    assert answer["supported_sdk_versions"] == {"min": tested[0], "max": tested[-1], "tested": tested}
    # The newest release tested is the one the suite's own SDK tests run (constraints.txt's pin): a bump of the pin
    # without the range, or the other way round, fails here.
    assert tested[-1] == pinned_release()
    # The SDK reads the answer as before: it ignores the field it does not know.
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    assert [m.trainable for m in rest.get_server_capabilities().result().supported_models] == [True]
    guide = (ROOT / "docs" / "guides" / "tinker.md").read_text()
    section = guide.split("## Supported SDK versions", 1)[1].split("\n## ", 1)[0]
    assert f"`{tested[0]}` to `{tested[-1]}`" in section
    assert all(f"`{release}`" in section for release in tested), "the guide names every release tested"


def test_external_weights_on_the_servers_disk(server, tiny_model_dir, fresh_experiments):
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    try:
        training = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=RANK).result()
        tokens = training.get_tokenizer().encode("One, two, three, four, five.")
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()

        path = training.save_weights_external("export").result().path
        assert path == f"tinker://{training.model_id}/external_weights/export"
        folder = server.run_dir / "tinker" / "external_weights" / training.model_id / "export"
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == RANK
        # The peft folder of the version that save pushed, as the learner wrote it (its newest version).
        experiment = "tinker-{}-{}".format(*training.model_id.removeprefix("sess-").split(":train:"))
        pushed = sorted((server.run_dir / "adapters" / experiment).glob("v*"))[-1]
        assert (folder / "adapter_model.safetensors").read_bytes() == \
            (pushed / "adapter_model.safetensors").read_bytes()

        listed = {c.checkpoint_id: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
        size = sum(f.stat().st_size for f in folder.iterdir())
        assert listed["external_weights/export"].checkpoint_type == "external"
        assert listed["external_weights/export"].size_bytes == size
        everything = rest.list_user_checkpoints(limit=1).result()
        assert len(everything.checkpoints) == 1 and everything.cursor.total_count >= 1
        assert path in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]

        with pytest.raises(tinker.BadRequestError, match="not served here"):
            rest.get_external_weights_urls(path).result()
        with pytest.raises(tinker.RequestFailedError, match="age_encryption_recipients"):
            training.save_weights_external("sealed", age_encryption_recipients=["age1xyz"]).result()
        rest.delete_checkpoint_from_tinker_path(path).result()
        assert not folder.exists()
        assert "external_weights/export" not in [c.checkpoint_id for c in
                                                 rest.list_checkpoints(training.model_id).result().checkpoints]
    finally:
        service.close("success").result(timeout=60)
