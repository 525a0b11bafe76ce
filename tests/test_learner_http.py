"""The learner as its own process: `python -m learner` started with a config file, talking msgpack over HTTP.

Covers the verbs end to end (add_experiment, logprobs, train, save_adapter with its probe, status,
remove_experiment), their error answers, and a clean exit on SIGTERM. The trainer in-process:
tests/test_learner.py and tests/test_learner_adapters.py.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from grpo_server.protocol.codec import MSGPACK, pack, unpack
from grpo_server.protocol.listen import free_port
from grpo_server.protocol.worker_auth import auth_headers
from tests.learner_helpers import COMPLETION, PROMPT, _sample
from tests.serving import WORKER_SECRET, worker_env

REPO = Path(__file__).resolve().parents[1]
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _post(url: str, verb: str, body) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/{verb}", data=body if isinstance(body, bytes) else pack(body),
                                     headers={"Content-Type": MSGPACK, **auth_headers(WORKER_SECRET)}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, unpack(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, unpack(exc.read())


@contextlib.contextmanager
def _learner_process(model_dir: Path, tmp_path: Path, **settings):
    """`python -m learner` on a config file of its own, healthy; its URL and run directory. Stopped with SIGTERM
    after, which must end it cleanly."""
    port = free_port()
    run_dir = tmp_path / "run"
    config_path = tmp_path / "learner.yaml"
    config_path.write_text(yaml.safe_dump({"model_path": str(model_dir), "run_dir": str(run_dir),
                                           "port": port, "max_model_len": 128, "dtype": "float32", **settings}))
    # The parent's rank / port variables (the in-process fixture's) must not leak into the child.
    env = {k: v for k, v in worker_env().items() if k not in DIST_ENV}
    log_file = open(tmp_path / "learner.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "learner", "--config", str(config_path)], cwd=REPO, env=env,
                            stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "learner.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200 and unpack(response.read()) == {"status": "ok"}:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "learner not healthy in 240 s"
            time.sleep(0.1)
        assert yaml.safe_load((run_dir / "config" / "learner.resolved.yaml").read_text())["port"] == port
        yield url, run_dir
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        finally:
            proc.kill()
            log_file.close()
    assert code == 0, (tmp_path / "learner.log").read_text()[-3000:]


def _status(url: str) -> dict:
    status_request = urllib.request.Request(f"{url}/status", headers=auth_headers(WORKER_SECRET))
    with urllib.request.urlopen(status_request, timeout=10) as response:
        return unpack(response.read())


def test_learner_process_serves_the_verbs_over_http(tiny_model_dir, tmp_path):
    with _learner_process(tiny_model_dir, tmp_path) as (url, run_dir):
        lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
        status, body = _post(url, "add_experiment", {"name": "web", "lora": lora, "algorithm": {"learning_rate": 1e-2}})
        assert status == 200 and body["version"] == 0 and Path(body["path"]).is_dir(), body
        # Scored as the version check below scores v0 (the same batch: its shapes decide the CPU kernels' order of
        # summation, and a batch of one differed from it by ~6e-6 on an AVX-512 box), so the two compare exactly.
        status, body = _post(url, "logprobs", {"name": "web", "prompt_token_ids": PROMPT,
                                               "completions_token_ids": [COMPLETION, COMPLETION[:2]]})
        assert status == 200 and len(body["logprobs"][0]) == len(COMPLETION), body
        before, before_batch = body["logprobs"][0], body["logprobs"]
        train = {"name": "web", "samples": [_sample(PROMPT, COMPLETION, before, 1.0, 1.0).model_dump()]}
        for step in (1, 2):
            status, body = _post(url, "train", train)
            assert status == 200 and body["step"] == step and body["tokens"] == len(COMPLETION), body
        status, body = _post(url, "save_adapter", {"name": "web"})
        assert status == 200 and body["version"] == 1 and body["path"].endswith("v000001"), body
        # The front end's check of the version: a probe scored under the saved weights, and the version before.
        probe = {"prompt_token_ids": PROMPT, "completions_token_ids": [COMPLETION, COMPLETION[:2]]}
        status, scored = _post(url, "score_version", {"name": "web", "version": 1, "previous": True, **probe})
        assert status == 200 and scored["version"] == 1 and scored["previous_version"] == 0, scored
        status, body = _post(url, "logprobs", {"name": "web", **probe})
        assert sum(body["logprobs"][0]) > sum(before)
        assert scored["logprobs"] == body["logprobs"]
        assert scored["previous_logprobs"] == before_batch  # v0's weights, copied in for the call and back out
        # Only right after the save: a version whose weights a step has moved since is refused, not scored wrong.
        status, body = _post(url, "score_version", {"name": "web", "version": 0, **probe})
        assert status == 409 and body["error"]["code"] == "weights_moved", body
        learner_status = _status(url)
        assert learner_status["experiments"]["web"] == {
            "step": 2, "version": 1, "resident": True,
            "path": str((run_dir / "adapters" / "web" / "v000001").resolve())}
        assert learner_status["dtype"] == "float32"  # dtype auto without CUDA: what the front end picks its check by

        assert _post(url, "train", {**train, "name": "ghost"}) == (
            404, {"error": {"code": "not_found", "message": "experiment 'ghost' is not loaded in the learner"}})
        status, body = _post(url, "add_experiment", {"name": "web", "lora": lora, "algorithm": {}})
        assert status == 409 and body["error"]["code"] == "exists"
        status, body = _post(url, "train", {"name": "web", "samples": [], "extra": 1})
        assert status == 400 and body["error"]["code"] == "bad_request" and "samples" in body["error"]["message"]
        status, body = _post(url, "train", b"\xc1 not msgpack")
        assert status == 400 and body["error"]["code"] == "bad_request"
        status, body = _post(url, "remove_experiment", {"name": "web"})
        assert status == 200 and body == {"removed": "web"}
        assert _post(url, "save_adapter", {"name": "web"})[0] == 404


def test_an_experiment_idle_past_page_out_idle_s_is_paged_out_and_back_in(tiny_model_dir, tmp_path):
    """The idle pager (learner/app.py): an experiment no verb reached for `page_out_idle_s` leaves the learner's
    memory while a busy one stays, and its next verb brings it back."""
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    probe = {"prompt_token_ids": PROMPT, "completions_token_ids": [COMPLETION]}
    with _learner_process(tiny_model_dir, tmp_path, page_out_idle_s=2.0) as (url, _):
        for name in ("busy", "idle"):
            assert _post(url, "add_experiment", {"name": name, "lora": lora, "algorithm": {}})[0] == 200
        status, before = _post(url, "logprobs", {"name": "idle", **probe})
        assert status == 200
        deadline = time.monotonic() + 60
        while _status(url)["experiments"]["idle"]["resident"]:
            assert time.monotonic() < deadline, "the idle experiment was never paged out"
            assert _post(url, "logprobs", {"name": "busy", **probe})[0] == 200  # a verb every 0.3 s keeps it in
            time.sleep(0.3)
        learner_status = _status(url)
        assert learner_status["experiments"]["busy"]["resident"] is True
        assert learner_status["paging"]["page_outs"] >= 1 and learner_status["paging"]["resident"] == 1
        assert _post(url, "logprobs", {"name": "idle", **probe}) == (200, before)  # paged in, the same weights
        assert _status(url)["experiments"]["idle"]["resident"] is True
