"""Python client for grpo_server: `AsyncClient` (aiohttp) and `Client` (the same calls, blocking).

    from grpo_server.client import Client
    with Client("http://127.0.0.1:8000", api_key) as client:
        client.create_experiment({"name": "alphabetize"})
        group = client.complete("alphabetize", messages=[{"role": "user", "content": "Sort: b a"}], n=8)
        client.feedback("alphabetize", group.group_id, [score(c.text) for c in group.completions])

Multi-turn (agents): send turn t+1 as token ids built from turn t's, so nothing the model wrote is
re-tokenized (`next_turn_prompt`); the prompt tokens, earlier model turns included, are never trained on.

        group = client.complete("agent", messages=[{"role": "user", "content": "3+4?"}], n=4)
        for completion in group.completions:
            prompt_ids = client.next_turn_prompt(group, completion, [{"role": "user", "content": "Times 2?"}])
            turn2 = client.complete("agent", prompt_token_ids=prompt_ids, n=1)

Episodes (agents on any OpenAI-based framework): every call of one run carries the episode's id, the
server keeps its turns, and `rate_episodes` rates a group of runs of one task as a whole (each sampled
token trains with its episode's advantage; prompts and tool outputs are masked).

    async with AsyncClient(url, api_key) as client:
        episodes = [client.episode("agent") for _ in range(8)]
        rewards = [await run_agent(ep.openai_client(), model="agent") for ep in episodes]  # your framework
        await client.rate_episodes("agent", episodes, rewards)

`Episode.openai_client()` is an `openai.AsyncOpenAI` (`sync=True`: `openai.OpenAI`) on the server with the
key and the `X-Episode-Id` header; `Episode.headers` / `Episode.extra_body` tag calls of a client you own.

External completions (a teacher's answer, a human fix): `feedback_external` for a prompt and completions
the model did not sample, or `feedback(..., extra_completions=[...])` to add them to a sampled group.
A completion is text (`"..."`), token ids (`[1, 2, 3]`) or a dict `{"text": ..., "append_eos": False}`.

Errors from the server raise `GrpoServerError` with its status, code and message. Needs only aiohttp and
pydantic (no torch).
"""

from __future__ import annotations

import asyncio
import ssl
import threading
import uuid
from pathlib import Path
from typing import Any, Coroutine, Sequence, TypeVar

import aiohttp

from grpo_server.api_models import (CompletionOut, CompletionsResponse, CreatedExperiment, ExperimentList,
                                    ExperimentStatus, FeedbackResponse, Health, RatedGroup, RatedGroups,
                                    TokenizeResponse)
from grpo_server.config import ExperimentConfig

T = TypeVar("T")
ExternalCompletionLike = str | Sequence[int] | dict  # text, token ids, or the API's {"text"|"token_ids", ...}


class GrpoServerError(Exception):
    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


class Episode:
    """One run of an agent, told to the server by its id on every call: `headers` (`X-Episode-Id`) or
    `extra_body` (`episode_id`); `openai_client()` sets the header for you. Rate it with its group through
    `rate_episodes`. `str(episode)` is its id."""

    def __init__(self, server_url: str, api_key: str, experiment: str, episode_id: str | None = None,
                 ssl_context: ssl.SSLContext | None = None):
        self.id = episode_id or uuid.uuid4().hex
        self.experiment = experiment  # the OpenAI `model`
        self.base_url = server_url.rstrip("/") + "/v1"  # the OpenAI `base_url`
        self._api_key = api_key
        self._ssl = ssl_context

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Episode-Id": self.id}

    @property
    def extra_body(self) -> dict[str, str]:
        return {"episode_id": self.id}

    def openai_client(self, *, sync: bool = False, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` (or `openai.OpenAI` with `sync=True`) whose every call is a turn of this
        episode; kwargs go to its constructor (`max_retries`, `timeout`, ...). Needs the `openai` package."""
        import openai  # only here: the client library itself does not need it

        kwargs["default_headers"] = {**(kwargs.get("default_headers") or {}), **self.headers}
        if self._ssl is not None and "http_client" not in kwargs:
            http = openai.DefaultHttpxClient if sync else openai.DefaultAsyncHttpxClient
            kwargs["http_client"] = http(verify=self._ssl)
        return (openai.OpenAI if sync else openai.AsyncOpenAI)(base_url=self.base_url, api_key=self._api_key,
                                                               **kwargs)

    def __str__(self) -> str:
        return self.id

    def __repr__(self) -> str:
        return f"Episode({self.id!r}, experiment={self.experiment!r})"


class AsyncClient:
    def __init__(self, base_url: str, api_key: str, timeout_s: float = 600.0,
                 ssl_context: ssl.SSLContext | None = None):
        """`ssl_context`: for an https server whose certificate the system does not trust, e.g.
        `ssl.create_default_context(cafile="server.pem")`."""
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl) if self._ssl is not None else None
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout, connector=connector)
        return self._session

    async def _request(self, method: str, path: str, json: Any = None, params: dict | None = None) -> Any:
        async with self._http().request(method, self.base_url + path, json=json, params=params) as response:
            if response.status >= 400:
                try:
                    error = (await response.json()).get("error", {})
                except (aiohttp.ContentTypeError, ValueError):
                    error = {"message": await response.text()}
                retry = response.headers.get("Retry-After")
                raise GrpoServerError(response.status, error.get("code", "error"), error.get("message", ""),
                                      float(retry) if retry else None)
            if response.content_type == "application/json":
                return await response.json()
            return await response.read()

    async def health(self) -> Health:
        return Health.model_validate(await self._request("GET", "/v1/health"))

    async def create_experiment(self, config: ExperimentConfig | dict, *, resume: bool = False) -> CreatedExperiment:
        """A new experiment (a name used before starts afresh); `resume`: the deleted one of that name, from
        its archive. Without an `api_key` in the config the answer's `api_key` is the one the server made."""
        body = dict(config) if isinstance(config, dict) else _config_body(config)
        if resume:
            body["resume"] = True
        return CreatedExperiment.model_validate(await self._request("POST", "/v1/experiments", json=body))

    async def list_experiments(self) -> list[ExperimentStatus]:
        return ExperimentList.model_validate(await self._request("GET", "/v1/experiments")).experiments

    async def status(self, experiment: str) -> ExperimentStatus:
        return ExperimentStatus.model_validate(await self._request("GET", f"/v1/experiments/{experiment}"))

    async def delete_experiment(self, experiment: str) -> None:
        await self._request("DELETE", f"/v1/experiments/{experiment}")

    async def pause_experiment(self, experiment: str) -> ExperimentStatus:
        """Admin key: stop sampling new groups (503 `experiment_paused`) and training, until `unpause_experiment`;
        feedback for groups sampled before is still taken. The server keeps the pause across restarts."""
        return ExperimentStatus.model_validate(await self._request("POST", f"/v1/experiments/{experiment}/pause"))

    async def unpause_experiment(self, experiment: str) -> ExperimentStatus:
        """Admin key: a paused experiment samples and trains again."""
        return ExperimentStatus.model_validate(await self._request("POST", f"/v1/experiments/{experiment}/unpause"))

    async def complete(self, experiment: str, prompt: str | None = None, *,
                       messages: list[dict] | None = None, prompt_token_ids: list[int] | None = None,
                       **sampling: Any) -> CompletionsResponse:
        """n completions of one prompt (give exactly one of prompt / messages / prompt_token_ids);
        sampling: n, temperature, top_p, max_tokens, stop, seed, and any other body field, e.g.
        `episode_id` (an id or an `Episode`; n must be 1) for a turn of an episode."""
        if isinstance(sampling.get("episode_id"), Episode):
            sampling["episode_id"] = sampling["episode_id"].id
        body = {"prompt": prompt, "messages": messages, "prompt_token_ids": prompt_token_ids, **sampling}
        body = {k: v for k, v in body.items() if v is not None}
        return CompletionsResponse.model_validate(
            await self._request("POST", f"/v1/experiments/{experiment}/completions", json=body))

    async def feedback(self, experiment: str, group_id: str, rewards: list[float],
                       extra_completions: Sequence[ExternalCompletionLike] | None = None) -> FeedbackResponse:
        """Rewards for a sampled group, in its completions' order; with `extra_completions`, rewards for
        those follow."""
        body: dict[str, Any] = {"group_id": group_id, "rewards": rewards}
        if extra_completions:
            body["extra_completions"] = [_external(c) for c in extra_completions]
        return FeedbackResponse.model_validate(
            await self._request("POST", f"/v1/experiments/{experiment}/feedback", json=body))

    def episode(self, experiment: str, episode_id: str | None = None) -> Episode:
        """A new episode of `experiment` (a fresh uuid4 hex id unless given); nothing is sent until its
        first call."""
        return Episode(self.base_url, self._api_key, experiment, episode_id, self._ssl)

    async def rate_episodes(self, experiment: str, episodes: Sequence[Episode | str],
                            rewards: Sequence[float]) -> FeedbackResponse:
        """Rewards for episodes of one task (at least two, one reward each), rated as a group: each one's
        advantage is relative to the others'. Once per episode (a repeat is 409)."""
        body = {"episode_ids": [str(e) for e in episodes], "rewards": [float(r) for r in rewards]}
        return FeedbackResponse.model_validate(
            await self._request("POST", f"/v1/experiments/{experiment}/feedback", json=body))

    async def feedback_external(self, experiment: str, completions: Sequence[ExternalCompletionLike],
                                rewards: list[float], prompt: str | None = None, *,
                                messages: list[dict] | None = None,
                                prompt_token_ids: list[int] | None = None) -> FeedbackResponse:
        """Train on completions the model did not sample (at least two, with their rewards). The server
        scores them under the serving version; the answer carries those logprobs."""
        body = {"prompt": prompt, "messages": messages, "prompt_token_ids": prompt_token_ids,
                "completions": [_external(c) for c in completions], "rewards": rewards}
        return FeedbackResponse.model_validate(await self._request(
            "POST", f"/v1/experiments/{experiment}/feedback", json={k: v for k, v in body.items() if v is not None}))

    async def tokenize(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                       add_generation_prompt: bool = True, continue_from: list[int] | None = None,
                       experiment: str | None = None, tools: list[dict] | None = None) -> TokenizeResponse:
        """Token ids exactly as the server builds a prompt. With `continue_from` (a conversation's token
        ids so far), `messages` are only the new turns and are appended after the model's turn ends.
        `experiment`: the one the ids are for; an experiment's key must name its own. `tools` (OpenAI
        function tools, with `messages`): rendered as completions render them."""
        body = {"prompt": prompt, "messages": messages, "add_generation_prompt": add_generation_prompt,
                "continue_from": continue_from, "experiment": experiment, "tools": tools}
        return TokenizeResponse.model_validate(
            await self._request("POST", "/v1/tokenize", json={k: v for k, v in body.items() if v is not None}))

    async def next_turn_prompt(self, group: CompletionsResponse, completion: CompletionOut | int,
                               new_turns: list[dict], add_generation_prompt: bool = True, *,
                               experiment: str | None = None) -> list[int]:
        """The prompt token ids of the next turn: this group's prompt + one of its completions (the
        object or its index) + `new_turns` (say, the user's or a tool's reply), without re-rendering the
        earlier turns. Pass the result as `prompt_token_ids` to `complete`. With an experiment's key, name
        it in `experiment`."""
        chosen = group.completions[completion] if isinstance(completion, int) else completion
        answer = await self.tokenize(messages=new_turns, add_generation_prompt=add_generation_prompt,
                                     continue_from=group.prompt_token_ids + chosen.token_ids,
                                     experiment=experiment)
        return answer.token_ids

    async def download_adapter(self, experiment: str, dest: str | Path, version: int | None = None) -> Path:
        """Save the adapter archive (.tar.gz of a peft folder) to `dest`; returns the file's path."""
        params = None if version is None else {"version": str(version)}
        data = await self._request("GET", f"/v1/experiments/{experiment}/adapter", params=params)
        dest = Path(dest)
        dest.write_bytes(data)
        return dest

    async def metrics(self, experiment: str, kind: str | None = None, limit: int | None = None) -> list[dict]:
        """The newest records of the experiment's metrics log, oldest first (`kind`: train, push or sampling;
        `limit`: 1-2000, default 500)."""
        params = {k: str(v) for k, v in {"kind": kind, "limit": limit}.items() if v is not None}
        answer = await self._request("GET", f"/v1/experiments/{experiment}/metrics", params=params or None)
        return answer["records"]

    async def rated_groups(self, experiment: str, limit: int | None = None) -> list[RatedGroup]:
        """The experiment's newest rated groups and episodes, oldest first: their completions' texts (clipped),
        rewards and advantages (`limit`: 1-32, default 32; the server keeps the newest 32, in memory)."""
        params = None if limit is None else {"limit": str(limit)}
        answer = await self._request("GET", f"/v1/experiments/{experiment}/rated", params=params)
        return RatedGroups.model_validate(answer).groups


def _external(completion: ExternalCompletionLike) -> dict:
    """An external completion's wire form: text, token ids, or a dict as the API takes it."""
    if isinstance(completion, str):
        return {"text": completion}
    if isinstance(completion, dict):
        return completion
    return {"token_ids": list(completion)}


def _config_body(config: ExperimentConfig) -> dict:
    body = config.model_dump(mode="json")
    body["api_key"] = config.api_key.get_secret_value() if config.api_key else None
    return body


class Client:
    """The blocking twin of AsyncClient: one event loop on a private thread runs its calls."""

    def __init__(self, base_url: str, api_key: str, timeout_s: float = 600.0,
                 ssl_context: ssl.SSLContext | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="grpo-client")
        self._thread.start()
        self._async = AsyncClient(base_url, api_key, timeout_s, ssl_context)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._async.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def health(self) -> Health:
        return self._run(self._async.health())

    def create_experiment(self, config: ExperimentConfig | dict, *, resume: bool = False) -> CreatedExperiment:
        return self._run(self._async.create_experiment(config, resume=resume))

    def list_experiments(self) -> list[ExperimentStatus]:
        return self._run(self._async.list_experiments())

    def status(self, experiment: str) -> ExperimentStatus:
        return self._run(self._async.status(experiment))

    def delete_experiment(self, experiment: str) -> None:
        return self._run(self._async.delete_experiment(experiment))

    def pause_experiment(self, experiment: str) -> ExperimentStatus:
        return self._run(self._async.pause_experiment(experiment))

    def unpause_experiment(self, experiment: str) -> ExperimentStatus:
        return self._run(self._async.unpause_experiment(experiment))

    def complete(self, experiment: str, prompt: str | None = None, **kwargs: Any) -> CompletionsResponse:
        return self._run(self._async.complete(experiment, prompt, **kwargs))

    def feedback(self, experiment: str, group_id: str, rewards: list[float],
                 extra_completions: Sequence[ExternalCompletionLike] | None = None) -> FeedbackResponse:
        return self._run(self._async.feedback(experiment, group_id, rewards, extra_completions))

    def episode(self, experiment: str, episode_id: str | None = None) -> Episode:
        return self._async.episode(experiment, episode_id)

    def rate_episodes(self, experiment: str, episodes: Sequence[Episode | str],
                      rewards: Sequence[float]) -> FeedbackResponse:
        return self._run(self._async.rate_episodes(experiment, episodes, rewards))

    def feedback_external(self, experiment: str, completions: Sequence[ExternalCompletionLike],
                          rewards: list[float], prompt: str | None = None, **kwargs: Any) -> FeedbackResponse:
        return self._run(self._async.feedback_external(experiment, completions, rewards, prompt, **kwargs))

    def tokenize(self, prompt: str | None = None, **kwargs: Any) -> TokenizeResponse:
        return self._run(self._async.tokenize(prompt, **kwargs))

    def next_turn_prompt(self, group: CompletionsResponse, completion: CompletionOut | int,
                         new_turns: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        return self._run(self._async.next_turn_prompt(group, completion, new_turns, add_generation_prompt, **kwargs))

    def download_adapter(self, experiment: str, dest: str | Path, version: int | None = None) -> Path:
        return self._run(self._async.download_adapter(experiment, dest, version))

    def metrics(self, experiment: str, kind: str | None = None, limit: int | None = None) -> list[dict]:
        return self._run(self._async.metrics(experiment, kind, limit))

    def rated_groups(self, experiment: str, limit: int | None = None) -> list[RatedGroup]:
        return self._run(self._async.rated_groups(experiment, limit))
