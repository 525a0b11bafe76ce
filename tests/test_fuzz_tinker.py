"""Fuzzing the Tinker `forward_backward` route with protobuf bodies (issue 46), over real HTTP on the session
`server` (real front end and DeepSpeed learner, tiny model): tests/fuzz_tinker_proto.py makes the bodies.

Properties of every case:
- the call answers at once with a future or a 4xx, never a 5xx;
- its future ends as the SDK expects, a protobuf result or a failure of category `user`: the client's mistake,
  never the server's (a `server` failure is a 5xx by another name);
- meanwhile `/v1/health` answers within a second, and the server's own `event_loop_lag_max_s` (its loop-lag watch,
  grpo_server/runtime/loop_lag.py) stays under a second: no body holds the event loop.

How many cases: GRPO_FUZZ_PROTO_EXAMPLES (default 120). The long run (over 10,000 cases):
`GRPO_FUZZ_PROTO_EXAMPLES=10000 pytest tests/test_fuzz_tinker.py -s`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests as http_requests
from hypothesis import HealthCheck, given, settings

tinker = pytest.importorskip("tinker")

from tests.fuzz_tinker_proto import requests as bodies  # noqa: E402
from tests.serving import ADMIN_KEY  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
EXAMPLES = int(os.environ.get("GRPO_FUZZ_PROTO_EXAMPLES", "120"))
SEEN: Counter = Counter()


@pytest.fixture(scope="module")
def target(server, tiny_model_dir, tokenizer):
    """A Tinker model of the admin's to aim at, and a session with the admin's key."""
    client = tinker.ServiceClient(base_url=server.url, api_key=f"tml-{ADMIN_KEY}")
    training = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=8).result()
    session = http_requests.Session()
    session.headers.update({"X-API-Key": f"tml-{ADMIN_KEY}"})
    yield server.url, training.model_id, len(tokenizer), session
    session.close()
    client.close("success").result(timeout=60)
    experiment = "tinker-" + training.model_id.split(":")[0].removeprefix("sess-") + "-" + \
        training.model_id.split(":")[-1]
    deleted = http_requests.delete(f"{server.url}/v1/experiments/{experiment}",
                                   headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=300)
    assert deleted.status_code == 204, deleted.text


def _outcome(session, url: str, request_id: str) -> tuple[str, str]:
    """(kind, detail) of a future: ("result", content type) or ("failure", category: code)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        answer = session.post(f"{url}/api/v1/retrieve_future", json={"request_id": request_id}, timeout=60)
        if answer.status_code == 408:
            continue
        assert answer.status_code == 200, (answer.status_code, answer.text)
        if answer.headers["Content-Type"].startswith("application/x-protobuf"):
            return "result", "protobuf"
        failed = answer.json()
        return "failure", f"{failed['category']}: {failed['error'].split(':')[0]}"
    raise AssertionError(f"future {request_id} did not finish in 120 s")


def test_forward_backward_protobuf_fuzz(target):
    url, model_id, vocab, session = target
    slowest_health, loop_lag, slowest_call, stop = [0.0], [0.0], [0.0], threading.Event()

    def watch_health() -> None:
        with http_requests.Session() as watcher:
            while not stop.is_set():
                started = time.monotonic()
                answer = watcher.get(f"{url}/v1/health", timeout=30)
                slowest_health[0] = max(slowest_health[0], time.monotonic() - started)
                assert answer.status_code == 200, (answer.status_code, answer.text)
                # The loop's own account (the last minute's largest lag): a stall between two of these asks too.
                loop_lag[0] = max(loop_lag[0], answer.json()["event_loop_lag_max_s"])
                time.sleep(0.05)

    # The watcher's failure is the test's: raised by result() below, not lost with its thread.
    watching = ThreadPoolExecutor(max_workers=1, thread_name_prefix="watch-health")
    watcher = watching.submit(watch_health)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(model_id, vocab))
    def one_case(body: bytes) -> None:
        if watcher.done():  # it failed: stop here, with its error
            watcher.result()
        started = time.monotonic()
        answer = session.post(f"{url}/api/v1/forward_backward", data=body,
                              headers={"Content-Type": "application/x-protobuf"}, timeout=60)
        took = time.monotonic() - started
        assert answer.status_code < 500, (answer.status_code, answer.text, body[:200])
        # The call only decodes (on a thread) and answers a future: seconds would mean it waited on something. Not
        # 1 s: on a shared 2-core box a busy neighbour alone can cost that; the loop's own hold is `health` below.
        assert took < 5.0, f"answered after {took:.2f} s"
        slowest_call[0] = max(slowest_call[0], took)
        if answer.status_code != 200:
            SEEN[f"http {answer.status_code} {answer.json()['error']['code']}"] += 1
            return
        kind, detail = _outcome(session, url, answer.json()["request_id"])
        assert kind == "result" or detail.startswith("user:"), (detail, body[:200])
        SEEN[f"{kind} {detail}"] += 1

    try:
        one_case()
    finally:
        stop.set()
        watching.shutdown(wait=False)
    watcher.result(timeout=60)
    print(f"\n{sum(SEEN.values())} protobuf cases: {json.dumps(dict(SEEN.most_common()), indent=1)}; "
          f"slowest call {slowest_call[0]:.3f} s, slowest /v1/health {slowest_health[0]:.3f} s, "
          f"event_loop_lag_max_s {loop_lag[0]:.3f} s")
    assert slowest_health[0] < 1.0
    assert 0 < loop_lag[0] < 1.0, loop_lag  # 0 exactly: no answer read, or a field that is never filled
    assert SEEN["result protobuf"] > 0, "no case was valid: the fuzz tests only the refusals"
