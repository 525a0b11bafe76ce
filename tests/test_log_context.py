"""One log format for every process (grpo_server/protocol/log_context.py): plain or JSON lines carrying the
experiment, version and request id bound where the work started; the id crosses from the front end to the workers
in a verb's headers. Units here; the same id in the front end's and the learner's logs on the real server below."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import uuid

import aiohttp

from grpo_server.protocol import log_context
from grpo_server.protocol.log_context import (REQUEST_ID_HEADER, ContextFilter, JsonFormatter, PlainFormatter, bound,
                                              context_headers, from_headers)
from tests.serving import wait_for


def _logger(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(ContextFilter())
    handler.setFormatter(formatter)
    logger = logging.getLogger(f"test-log-context-{uuid.uuid4().hex}")
    logger.propagate = False
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return logger, out


def test_json_lines_carry_the_bound_fields_and_the_traceback():
    logger, out = _logger(JsonFormatter("learner-rank0"))
    logger.info("outside")
    with bound(experiment="alpha", request_id="req-1"):
        with bound(version=3):
            logger.info("step %d", 7)
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [set(line) - {"time", "level", "process", "logger", "message"} for line in lines] == [
        set(), {"experiment", "version", "request_id"}, {"experiment", "request_id", "exception"}]
    assert lines[1]["message"] == "step 7" and lines[1]["version"] == 3 and lines[1]["process"] == "learner-rank0"
    assert "ValueError: boom" in lines[2]["exception"] and lines[2]["level"] == "ERROR"


def test_plain_lines_end_with_the_fields_before_a_traceback():
    logger, out = _logger(PlainFormatter("frontend"))
    with bound(experiment="alpha", version=2, request_id="req-9"):
        try:
            raise KeyError("k")
        except KeyError:
            logger.exception("lost")
    logger.info("after")
    first, *rest = out.getvalue().splitlines()
    assert first.endswith("frontend test-log-context-" + first.split("test-log-context-")[1].split(":")[0]
                          + ": lost [experiment=alpha version=2 request=req-9]")
    assert any("KeyError" in line for line in rest) and rest[-1].endswith(": after")  # unbound again


async def test_tasks_keep_the_context_they_were_started_in():
    async def inner() -> dict:
        await asyncio.sleep(0)
        return log_context.current()

    with bound(request_id="req-task", experiment="beta"):
        task = asyncio.create_task(inner())
        threaded = asyncio.to_thread(log_context.current)
        assert await task == await threaded == {"request_id": "req-task", "experiment": "beta"}
    assert log_context.current() == {}


def test_headers_round_trip_and_odd_values_are_dropped():
    with bound(request_id="req-abc", experiment="gamma", version=5):
        headers = context_headers()
    assert from_headers(headers) == {"request_id": "req-abc", "experiment": "gamma", "version": 5}
    assert from_headers({REQUEST_ID_HEADER: "x" * 200, "X-Grpo-Experiment": "bad value\nforged line"}) == {}


# ------------------------------------------------------------------------------------------------
# On the real server: the client's id comes back, and a train step's id is in both processes' logs
# ------------------------------------------------------------------------------------------------


async def test_a_request_id_comes_back_and_a_step_id_is_in_the_front_end_and_learner_logs(server, client):
    name = f"logs-{uuid.uuid4().hex[:6]}"
    await client.create_experiment({"name": name, "sampling": {"n": 2, "max_tokens": 4},
                                    "algorithm": {"batch_groups": 1}})
    try:
        async with aiohttp.ClientSession() as session:
            headers = {"Authorization": f"Bearer {server.api_key}", REQUEST_ID_HEADER: "client-chosen-1"}
            async with session.post(f"{server.url}/v1/experiments/{name}/completions", json={"prompt": "Hi"},
                                    headers=headers) as answer:
                assert answer.status == 200 and answer.headers[REQUEST_ID_HEADER] == "client-chosen-1"
                group = await answer.json()
            stream = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 2}
            async with session.post(f"{server.url}/v1/chat/completions", json=stream,
                                    headers={**headers, REQUEST_ID_HEADER: "client-stream-1"}) as answer:
                assert answer.headers[REQUEST_ID_HEADER] == "client-stream-1"  # sent before the first event
                assert b"[DONE]" in await answer.read()
            async with session.get(f"{server.url}/v1/experiments/{name}/status",
                                   headers={"Authorization": f"Bearer {server.api_key}"}) as answer:
                assert re.fullmatch(r"req-[0-9a-f]{16}", answer.headers[REQUEST_ID_HEADER])  # one made for it
        await client.feedback(name, group["group_id"], [1.0, 0.0])
        await wait_for(lambda: _pushed(client, name), timeout_s=300)

        step = re.compile(rf"{name}: step 1 .*\[experiment={name} version=0 request=(step-[0-9a-f]{{16}})\]")
        front = [m.group(1) for line in server.log_path.read_text().splitlines() if (m := step.search(line))]
        assert len(front) == 1, server.log_tail()
        learner_log = (server.run_dir / "logs" / "learner.log").read_text()
        assert re.search(rf"{name}: step 1, .*\[experiment={name} version=0 request={front[0]}\]", learner_log), \
            learner_log[-3000:]
    finally:
        await client.delete_experiment(name)


async def _pushed(client, name: str):
    status = await client.status(name)
    return status if status.policy_version >= 1 else None
