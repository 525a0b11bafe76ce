"""`stream: true` on the OpenAI routes (grpo_server/api/openai/streaming.py): through the official `openai` package and
plain aiohttp against the real server on the tiny model, and the framing against a fake experiment whose
sampling the test holds (a worker failure after the headers, a client that leaves), deterministically."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from types import SimpleNamespace

import aiohttp
import openai
import pytest
from aiohttp import web
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from grpo_server.api.openai.models import chat_response
from grpo_server.api.openai.streaming import Framing, pieces, stream_group
from grpo_server.api_models import CompletionOut, CompletionsRequest, CompletionsResponse
from grpo_server.protocol.errors import WorkerFailed
from grpo_server.protocol.wire import ToolCall
from grpo_server.runtime.groups import Group, GroupStore
from tests.serving import headers, wait_for

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
async def experiment(client, request):
    name = "sse-" + request.node.name.lower().replace("_", "-")[:56]
    await client.create_experiment({"name": name, "sampling": {"n": 2, "max_tokens": 8, "temperature": 1.0}})
    yield name
    await client.delete_experiment(name)


def openai_client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)


def events(raw: bytes) -> list[str]:
    """The `data` of each event, checking OpenAI's framing: `data: ...` and a blank line, nothing else but
    keep-alive comments."""
    text = raw.decode()
    assert text.endswith("\n\n"), text[-200:]
    found = []
    for event in text[:-2].split("\n\n"):
        if event.startswith(":"):
            continue
        assert event.startswith("data: ") and "\n" not in event, event
        found.append(event[len("data: "):])
    return found


# ------------------------------------------------------------------------------------------------
# Against the real server
# ------------------------------------------------------------------------------------------------


async def test_chat_stream_rebuilds_the_plain_answer(server, experiment):
    ask = {"model": experiment, "messages": MESSAGES, "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 7,
           "logprobs": True}
    async with openai_client(server.url, server.api_key) as oai:
        plain = await oai.chat.completions.create(**ask)
        raw = await oai.chat.completions.with_raw_response.create(**ask, stream=True,
                                                                  stream_options={"include_usage": True})
        chunks = [chunk async for chunk in raw.parse()]
    group_id = raw.headers["X-Group-Id"]
    assert raw.headers["Content-Type"].startswith("text/event-stream")
    assert chunks[0].model_extra["group_id"] == group_id and chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == f"chatcmpl-{group_id}" and c.object == "chat.completion.chunk" for c in chunks)
    *body, last = chunks
    assert last.choices == [] and last.usage == plain.usage and all(c.usage is None for c in body)
    text, token_ids, logprobs, finish = defaultdict(str), defaultdict(list), defaultdict(list), {}
    for chunk in body:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            token_ids[choice.index] += choice.model_extra["token_ids"]
            logprobs[choice.index] += [e.token for e in choice.logprobs.content] if choice.logprobs else []
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    for choice in plain.choices:  # the same seed: the same tokens, so exactly the same text
        assert text[choice.index] == choice.message.content
        assert token_ids[choice.index] == choice.model_extra["token_ids"]
        assert logprobs[choice.index] == [e.token for e in choice.logprobs.content]
        assert finish[choice.index] == choice.finish_reason
    assert len(body) > 2 * len(plain.choices)  # the text came in pieces, not whole
    assert {c.model_extra["policy_version"] for c in body[2:]} == {plain.model_extra["policy_version"]}
    assert [c.model_extra["prompt_token_ids"] for c in body if c.model_extra.get("prompt_token_ids")] == [
        plain.model_extra["prompt_token_ids"]]
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.url}/v1/experiments/{experiment}/feedback", headers=headers(),
                                json={"group_id": group_id, "rewards": [1.0, 0.0]}) as response:
            assert response.status == 202, await response.text()


async def test_legacy_stream_framing_and_usage(server, experiment):
    url, ask = f"{server.url}/v1/completions", {"model": experiment, "prompt": "Once upon a time", "n": 2,
                                                  "max_tokens": 8, "temperature": 1.0, "seed": 3}
    async with aiohttp.ClientSession(headers=headers()) as session:
        async with session.post(url, json=ask) as response:
            plain = await response.json()
            assert response.headers["X-Group-Id"] == plain["group_id"]  # plain answers carry it too
        usage = {"stream": True, "stream_options": {"include_usage": True}}
        async with session.post(url, json={**ask, **usage}) as response:
            assert response.status == 200 and response.content_type == "text/event-stream"
            group_id, raw = response.headers["X-Group-Id"], await response.read()
        async with session.post(url, json={**ask, "max_tokens": 2, "stream": True}) as response:
            without_usage = [json.loads(d) for d in events(await response.read())[:-1]]
    data = events(raw)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == f"cmpl-{group_id}" and c["group_id"] == group_id
               for c in chunks)
    *body, last = chunks
    assert last["choices"] == [] and last["usage"] == plain["usage"] and all(c["usage"] is None for c in body)
    assert all("usage" not in c for c in without_usage)
    text = defaultdict(str)
    for chunk in body:
        for choice in chunk["choices"]:
            text[choice["index"]] += choice["text"]
    assert [text[c["index"]] for c in plain["choices"]] == [c["text"] for c in plain["choices"]]


async def test_client_that_leaves_mid_stream_leaves_no_group(server, client, experiment):
    """Gone after the first chunk, while its group is being sampled: the group is sampled, then dropped (n=1:
    the first chunk is the only one written before sampling ends)."""
    async with aiohttp.ClientSession(headers=headers()) as session:
        for _ in range(3):
            if await _leave_mid_stream(session, server.url, client, experiment):
                return
    pytest.fail("the group of a client that left stayed pending, three times")


async def _leave_mid_stream(session: aiohttp.ClientSession, url: str, client, experiment: str) -> bool:
    before = await client.status(experiment)
    ask = {"model": experiment, "messages": MESSAGES, "n": 1, "max_tokens": 128, "stream": True}
    response = await session.post(f"{url}/v1/chat/completions", json=ask)
    assert response.status == 200
    first = json.loads((await response.content.readuntil(b"\n\n"))[len(b"data: "):])
    group_id = response.headers["X-Group-Id"]
    assert first["group_id"] == group_id
    response.close()  # gone while the group is being sampled

    async def sampled():
        status = await client.status(experiment)
        return status.counters.groups_sampled == before.counters.groups_sampled + 1

    async def settled():  # sampled, then dropped as its content failed to go out (the same handler, at once)
        return (await client.status(experiment)).pending_groups == before.pending_groups

    await wait_for(sampled, 60, 0.1)
    try:
        await wait_for(settled, 2, 0.1)
    except TimeoutError:
        # The sampler finished before the close reached the server (a loaded machine can hold this client
        # up that long), so the content went out to a socket still open as far as the server could tell.
        await client.feedback(experiment, group_id, [1.0])
        return False
    async with session.post(f"{url}/v1/experiments/{experiment}/feedback",
                            json={"group_id": group_id, "rewards": [1.0]}) as answer:
        assert answer.status == 404  # gone, as an expired group
    return True


async def test_errors_before_the_stream_are_plain_json(server, experiment):
    async with openai_client(server.url, server.api_key) as oai:
        with pytest.raises(openai.NotFoundError) as info:
            await oai.chat.completions.create(model="no-such-experiment", messages=MESSAGES, stream=True)
        assert info.value.code == "experiment_not_found"
        with pytest.raises(openai.UnprocessableEntityError):
            await oai.completions.create(model=experiment, prompt="x", n=0, stream=True)
        with pytest.raises(openai.BadRequestError) as info:
            await oai.chat.completions.create(model=experiment, messages=MESSAGES, stream=True,
                                              extra_body={"episode_id": "ep-a"}, extra_headers={"X-Episode-Id": "ep-b"})
        assert info.value.code == "episode_id_mismatch"
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.url}/v1/completions", headers=headers("wrong-key"),
                                json={"model": experiment, "prompt": "x", "stream": True}) as response:
            assert response.status == 401 and response.content_type == "application/json"
            assert (await response.json())["error"]["code"] == "invalid_key"


async def test_episode_header_is_passed_through(server, experiment):
    """The X-Episode-Id header makes the call an episode's turn (runtime/episodes.py), echoed back."""
    async with aiohttp.ClientSession(headers=headers()) as session:
        async with session.post(f"{server.url}/v1/chat/completions", headers={"X-Episode-Id": "ep-1"},
                                json={"model": experiment, "messages": MESSAGES, "stream": True}) as response:
            assert response.status == 200, await response.text()
            assert response.headers["X-Episode-Id"] == "ep-1" and "X-Group-Id" not in response.headers
            chunks = [json.loads(d) for d in events(await response.read())[:-1]]
    assert all(c["episode_id"] == "ep-1" and c["group_id"] is None for c in chunks)
    assert {c["choices"][0]["index"] for c in chunks} == {0}  # an episode's turn is one completion


async def test_a_policy_trained_into_special_tokens_streams_without_stalling_the_server(server, tiny_model_dir,
                                                                                        tokenizer):
    """Issue 57, as a tenant would do it on purpose: a few Tinker SFT steps teach its adapter to emit only
    `<|im_start|>` (a special token: it decodes to nothing), its weights serve, and a stream of 32 choices of
    ~440 of them goes out. Before, cutting each choice re-decoded it from its start on the event loop (the old
    code held the loop ~0.2 s here); the server's own event_loop_lag_max_s stays under 0.1 s."""
    tinker = pytest.importorskip("tinker")
    from tinker import types

    key, name, special = "sse-special-key-7c8d9e0f", "sse-special", tokenizer.convert_tokens_to_ids("<|im_start|>")
    async with aiohttp.ClientSession(headers=headers()) as session:
        async with session.post(f"{server.url}/v1/experiments",
                                json={"name": name, "api_key": key, "lora": {"r": 8}}) as created:
            assert created.status == 201, await created.text()
    try:
        prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)

        def train() -> None:
            with tinker.ServiceClient(base_url=server.url, api_key=f"tml-{key}") as service:
                training = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=8)
                sequence = [*prompt, *[special] * 48]
                datum = types.Datum(model_input=types.ModelInput.from_ints(sequence[:-1]), loss_fn_inputs={
                    "target_tokens": sequence[1:], "weights": [0.0] * (len(prompt) - 1) + [1.0] * 48})
                for _ in range(5):
                    training.forward_backward([datum], "cross_entropy").result()
                    training.optim_step(types.AdamParams(learning_rate=0.05)).result()
                training.save_weights_for_sampler(name="special").result()  # now served

        await asyncio.to_thread(train)

        async def lag() -> float:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{server.url}/v1/health") as answer:
                    return (await answer.json())["event_loop_lag_max_s"]

        # Twice at most: the lag also counts time the loop waited for a core, and on a loaded 2-core box (the other
        # test worker's server) one such wait went over 0.1 s once. The stall this test is about comes back on
        # every stream; a wait for a core does not.
        lags = []
        for _ in range(2):
            await wait_for(lambda: _below(lag, 0.1), timeout_s=70)  # the window (the last minute) holds no stall
            async with openai_client(server.url, key) as oai:
                stream = await oai.chat.completions.create(model=name, messages=MESSAGES, n=32, max_tokens=440,
                                                           temperature=0.0, stream=True)
                ids = defaultdict(list)
                async for chunk in stream:
                    for choice in chunk.choices:
                        ids[choice.index] += choice.model_extra["token_ids"]
            assert len(ids) == 32 and sum(len(v) for v in ids.values()) > 32 * 400
            assert sum(i == special for v in ids.values() for i in v) > 0.95 * sum(len(v) for v in ids.values())
            lags.append(await lag())
            if lags[-1] < 0.1:
                break
        assert lags[-1] < 0.1, lags
    finally:
        async with aiohttp.ClientSession(headers=headers()) as session:
            async with session.delete(f"{server.url}/v1/experiments/{name}") as deleted:
                assert deleted.status == 204


async def _below(measure, bound: float) -> bool:
    return await measure() < bound


# ------------------------------------------------------------------------------------------------
# The framing alone: a fake experiment, and the chunks of a plain answer
# ------------------------------------------------------------------------------------------------


def decode(ids) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


class HeldExperiment:
    """Samples when the test says so: a result (stored as a pending group), or a worker failure."""

    def __init__(self):
        self.name, self.config = "held", SimpleNamespace(sampling=SimpleNamespace(n=2))
        self.groups, self.release, self.fail = GroupStore(ttl_s=60), asyncio.Event(), False
        self.stored, self.abandoned = [], []

    async def complete(self, request, group_id=None, admitted=None):
        admitted.set()
        await self.release.wait()
        if self.fail:
            raise WorkerFailed("sampler-0: out of memory")
        completions = [CompletionOut(text=decode([i, 1, 2]), token_ids=[i, 1, 2], logprobs=[-1.0] * 3,
                                     finish_reason="length") for i in range(2)]
        self.groups.add(Group(group_id=group_id, experiment=self.name, prompt_token_ids=[1], completions=[],
                              policy_version=0, temperature=1.0, max_tokens=3))
        self.stored.append(group_id)
        return CompletionsResponse(group_id=group_id, policy_version=0, prompt_token_ids=[1], completions=completions)

    def abandon(self, group_id, episode_id=None):
        self.abandoned.append(group_id)
        self.groups.discard(self.name, group_id)


@pytest.fixture(params=[False, True], ids=["as-served", "handler-cancellation"])
async def held(request):
    """The stream on its own server: as `grpo-server serve` runs it (a handler outlives its client), and with
    aiohttp's handler cancellation (a handler is cancelled when its client goes)."""
    fake = HeldExperiment()

    async def handler(request):
        return await stream_group(request, fake, CompletionsRequest(prompt="x"), chat=True, model="held",
                                  include_usage=False, decode=decode,
                                  answer=lambda result: chat_response("held", result, 0))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, handler_cancellation=request.param)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        yield fake, f"http://{host}:{port}", request.param
    finally:
        await runner.cleanup()


async def test_a_worker_failure_after_the_headers_ends_the_stream_with_an_error_event(held):
    fake, url, _ = held
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/chat/completions", json={}) as response:
            assert response.status == 200
            head = await response.content.readuntil(b"\n\n")
            fake.fail = True
            fake.release.set()
            data = events(head + await response.read())
    assert [json.loads(d)["choices"][0]["delta"] for d in data[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert json.loads(data[2]) == {"error": {"code": "worker_error", "message": "sampler-0: out of memory",
                                             "type": "server_error", "param": None}}
    assert len(data) == 3  # no [DONE]
    assert fake.groups.pending_count("held") == 0
    fake.release.clear()
    async with openai_client(url, "any") as oai:  # the openai package raises it
        stream = await oai.chat.completions.create(model="held", messages=MESSAGES, stream=True)
        fake.release.set()
        with pytest.raises(openai.APIError, match="out of memory"):
            async for _ in stream:
                pass


async def test_a_client_that_leaves_gets_its_group_dropped_and_no_task_stays(held):
    fake, url, handler_cancellation = held
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{url}/v1/chat/completions", json={})
        group_id = response.headers["X-Group-Id"]
        await response.content.readuntil(b"\n\n")
        response.close()
    await asyncio.sleep(0.1)  # the server sees the connection go
    fake.release.set()
    await wait_for(lambda: asyncio.sleep(0, fake.abandoned), 5, 0.05)
    assert fake.abandoned == [group_id] and fake.groups.pending_count("held") == 0
    # Served as the server runs: the group was sampled, then dropped. Cancelled: never stored at all.
    assert fake.stored == ([] if handler_cancellation else [group_id])
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("stream-")]


def test_pieces_rebuild_the_text_exactly(tokenizer):
    def tokens(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    text = "Hello, wörld! 😀 ça va?\n\n日本語"
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    cut = pieces(tokens, ids, text)
    assert "".join(t for _, t in cut) == text and [i for piece, _ in cut for i in piece] == ids
    assert len(cut) > 10 and cut[-1] == ([tokenizer.eos_token_id], "")  # per token; the end-of-turn token last
    stopped = text[:text.index("ça")]  # a stop string cut the text short of its ids
    cut = pieces(tokens, ids, stopped)
    assert "".join(t for _, t in cut) == stopped and [i for piece, _ in cut for i in piece] == ids


def test_tool_calls_stream_as_openai_accumulates_them():
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')
    result = CompletionsResponse(group_id="grp_1", policy_version=2, prompt_token_ids=[1], completions=[
        CompletionOut(text="Sure. <tool_call>...</tool_call>", token_ids=[5, 6, 7], logprobs=[-1.0] * 3,
                      finish_reason="tool_calls", tool_calls=[call], content="Sure.")])
    framing = Framing(chat=True, id="chatcmpl-grp_1", created=0, model="m", group_id="grp_1", episode_id=None,
                      include_usage=False)
    state = ChatCompletionStreamState()
    for data in framing.body(chat_response("m", result, 0), decode, announced=0):
        state.handle_chunk(ChatCompletionChunk.model_validate_json(data))
    message = state.get_final_completion().choices[0].message
    assert message.content == "Sure." and message.role == "assistant"
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("call_1", "get_weather", '{"city": "Oslo"}')]
    assert state.get_final_completion().choices[0].finish_reason == "tool_calls"


def test_pieces_cost_is_linear_in_tokens_that_make_no_text(tokenizer):
    """A choice of special tokens (decoding to nothing) and of half characters: every decode call sees a short
    window, not the choice so far (issue 57: 109 ms for one 2,000-token choice, on the event loop)."""
    seen: list[int] = []

    def tokens(ids):
        seen.append(len(ids))
        return tokenizer.decode(ids, skip_special_tokens=True)

    special = [i for i in tokenizer.all_special_ids if i != tokenizer.eos_token_id][0]
    half = tokenizer.encode("😀", add_special_tokens=False)
    assert len(half) > 1 and tokenizer.decode(half[:1]).endswith("\ufffd")  # a character over several tokens
    ids = [special] * 2000 + tokenizer.encode(" sorted", add_special_tokens=False) + [special] * 500 + half * 300
    text = tokens(ids)
    seen.clear()
    cut = pieces(tokens, ids, text)
    assert "".join(t for _, t in cut) == text and [i for piece, _ in cut for i in piece] == ids
    assert max(seen) <= 16 and len(seen) < 2 * len(ids), (max(seen), len(seen))
    assert cut[0][0][-1] != special and len(cut[0][0]) > 2000  # the special ids went with the first text
    # half a character alone, over and over (never completed): it goes out after MAX_PENDING_TOKENS at most
    broken = half[:1] * 3000
    text = tokens(broken)
    seen.clear()
    cut = pieces(tokens, broken, text)
    assert "".join(t for _, t in cut) == text and max(seen) <= 16 and len(cut) > 100


async def test_a_stream_of_special_tokens_never_holds_the_event_loop(tokenizer):
    """32 choices of 2,000 special tokens each (a policy degenerated into them, or a tenant that trained it so),
    streamed over real HTTP with the real tokenizer's decoding: the loop's lag, as the server's own monitor
    (runtime/loop_lag.py) measures it, stays under 0.1 s, and the text and ids arrive whole."""
    from grpo_server.runtime.loop_lag import LoopLag

    special = [i for i in tokenizer.all_special_ids if i != tokenizer.eos_token_id][0]
    ids = [special] * 1999 + tokenizer.encode(" end", add_special_tokens=False)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    choices = 32

    class Degenerate(HeldExperiment):
        async def complete(self, request, group_id=None, admitted=None):
            admitted.set()
            return CompletionsResponse(group_id=group_id, policy_version=0, prompt_token_ids=[1], completions=[
                CompletionOut(text=text, token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="length")
                for _ in range(choices)])

    fake = Degenerate()

    async def handler(request):
        return await stream_group(request, fake, CompletionsRequest(prompt="x", n=choices), chat=True,
                                  model="held", include_usage=False,
                                  decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                  answer=lambda result: chat_response("held", result, 0))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()

    async def streamed_with_lag() -> LoopLag:
        lag = LoopLag(interval_s=0.005)
        watcher = asyncio.create_task(lag.watch_forever())
        try:
            host, port = runner.addresses[0][:2]
            async with openai_client(f"http://{host}:{port}", "any") as oai:
                stream = await oai.chat.completions.create(model="held", messages=MESSAGES, n=choices, stream=True)
                got, token_ids = defaultdict(str), defaultdict(list)
                async for chunk in stream:
                    for choice in chunk.choices:
                        got[choice.index] += choice.delta.content or ""
                        token_ids[choice.index] += choice.model_extra["token_ids"]
        finally:
            watcher.cancel()
        assert got == {i: text for i in range(choices)} and token_ids == {i: ids for i in range(choices)}
        return lag

    # Twice at most, as the server-side test above: the lag also counts time this process waited for a core (336 ms
    # once, with the other test worker starting a server). The stall this test is about comes back on every stream.
    try:
        stalls = []
        for _ in range(2):
            lag = await streamed_with_lag()
            assert lag.count > 10
            stalls.append(round(lag.max_s, 3))
            if lag.max_s < 0.1:
                break
    finally:
        await runner.cleanup()
    assert stalls[-1] < 0.1, f"the event loop stalled (s): {stalls}"
