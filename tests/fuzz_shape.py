"""How tests/test_fuzz.py shapes what schemathesis draws before it is sent (split from tests/fuzz_schema.py, which
holds the schemathesis set-up and the checks): `cheapen` keeps sampling cheap, `shape` makes calls reach a live
experiment (fitted prompts, streams, episode turns and their ratings, tracked by `Episodes`)."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Any

import schemathesis
from jsonschema import Draft202012Validator

from tests.fuzz_schema import CHEAP, DOCUMENT, EPISODE_PREFIX, sampled


def _is_count(value: Any) -> bool:
    """An integer as JSON Schema has it (and pydantic takes it): 5, or 5.0."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and
                                                                       value.is_integer())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def cheapen(case: schemathesis.Case) -> None:
    """A request that would sample more than CHEAP completions or tokens samples CHEAP instead. Only a value
    the schema allows is changed (to another it allows), so valid data stays valid and invalid data invalid;
    an experiment created by the fuzzing gets cheap defaults and trains in small batches."""
    body = case.body
    if not isinstance(body, dict):
        return
    experiment = case.path == "/v1/experiments"
    sampling = body.get("sampling") if experiment else body
    if isinstance(sampling, dict):
        for key, most in COUNT_MAXIMA.items():
            if _is_count(sampling.get(key)) and CHEAP < sampling[key] <= most:
                sampling[key] = CHEAP
    algorithm = body.get("algorithm") if experiment else None
    if isinstance(algorithm, dict) and _is_count(algorithm.get("batch_groups")) and algorithm["batch_groups"] < 2:
        algorithm["batch_groups"] = 2  # a learner step per two rated groups at most


# The largest value of each count that the schemas allow (where they bound it): only those are lowered.
COUNT_MAXIMA = {"n": 256, "best_of": 256, "max_tokens": 2 ** 20, "max_completion_tokens": 2 ** 20,
                "max_output_tokens": 2 ** 20}  # POST /v1/responses's


PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
# The native request's fields, which the OpenAI routes' sampling fields become (openai_models.py): their
# bounds are the native schema's, which the OpenAI schema (OpenAI's own, unbounded) does not state.
NATIVE_FIELDS = DOCUMENT["components"]["schemas"]["CompletionsRequest"]["properties"]
AS_NATIVE = {"n": "n", "temperature": "temperature", "top_p": "top_p", "max_tokens": "max_tokens",
             "max_completion_tokens": "max_tokens", "seed": "seed", "stop": "stop"}


def _fits_native(key: str, value: Any) -> bool:
    value = [value] if key == "stop" and isinstance(value, str) else value  # a string is a list of one
    return Draft202012Validator(NATIVE_FIELDS[AS_NATIVE[key]]).is_valid(value)


OPENAI_HONOURED = {"model", "messages", "prompt", "n", "temperature", "top_p", "max_tokens",
                   "max_completion_tokens", "stop", "seed", "logprobs", "stream", "stream_options", "episode_id"}
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions")


class Episodes:
    """Episode ids for the fuzzed calls, and which of them were sampled and not rated yet, per experiment, so
    that `shape` can make a completions call one turn of an episode (a new one, or one with fewer than TURNS
    turns) and a feedback call the rating of episodes that exist (`episode_ids`). `seen` keeps it up to date
    from each answer; episodes named in a feedback call leave the book whatever its answer (a refused reward
    leaves them pending on the server until `episode_ttl_s`, as a client that gave up would)."""

    TURNS = 3

    def __init__(self, prefix: str):
        assert prefix.startswith(EPISODE_PREFIX), prefix
        self.prefix = prefix
        self.fresh = itertools.count()
        self.open: dict[str, dict[str, int]] = defaultdict(dict)  # experiment -> episode id -> turns sampled

    def turn_id(self, experiment: str, turn: int) -> str:
        going = [e for e, turns in self.open[experiment].items() if turns < self.TURNS]
        return going[turn % len(going)] if going and turn % 2 else f"{self.prefix}-{next(self.fresh)}"

    def ready(self, experiment: str, turn: int) -> list[str]:
        """Two to four sampled episodes of `experiment`, oldest first (empty if fewer than two)."""
        ids = list(self.open[experiment])
        return ids[:2 + turn % 3] if len(ids) >= 2 else []

    def seen(self, case: schemathesis.Case, response) -> None:
        body = case.body if isinstance(case.body, dict) else {}
        if case.path.endswith("/feedback") and isinstance(body.get("episode_ids"), list):
            for episode_id in body["episode_ids"]:
                if isinstance(episode_id, str):  # (fuzzed ones may be anything)
                    self.open[str(case.path_parameters["name"])].pop(episode_id, None)
        elif case.path.endswith("completions") and response.status_code == 200:
            episode_id = sampled(case, response)[1]
            experiment = body.get("model") if case.path in OPENAI_PATHS else case.path_parameters["name"]
            if episode_id is not None:
                turns = self.open[experiment]
                turns[episode_id] = turns.get(episode_id, 0) + 1


def _text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _fit_openai_prompt(body: dict[str, Any]) -> None:
    """The OpenAI prompt as the server takes it (the legacy route: one prompt, not empty, logprobs 0 or 1;
    chat: no `tool` message or assistant `tool_calls` out of thin air, text parts only): the OpenAI schema
    allows much the server refuses (400s: openai_models.py), so that a shaped call gets to the sampler."""
    prompt = body.get("prompt")
    one_prompt = (isinstance(prompt, str) and prompt != "") or (
        isinstance(prompt, list) and len(prompt) > 0 and (isinstance(prompt[0], int) or len(prompt) == 1 and prompt[0]))
    if "prompt" in body and not one_prompt:  # text, token ids, or a list of one of either, not empty
        body["prompt"] = "Once upon a time"
    if _is_count(body.get("logprobs")) and body["logprobs"] > 1:
        body.pop("logprobs")
    if isinstance(body.get("messages"), list):
        messages = [m for m in body["messages"] if isinstance(m, dict) and m.get("role") != "tool"]
        for message in messages:
            message.pop("tool_calls", None)
            content = message.get("content")
            if isinstance(content, list) and not all(_text_part(part) for part in content):
                message["content"] = "Name a colour."
        body["messages"] = messages or [{"role": "user", "content": "Name a colour."}]


def _as_episode_turn(case: schemathesis.Case, body: dict[str, Any], experiment: str, turn: int,
                     episodes: Episodes) -> None:
    """One completion (n = 1) of an episode, at the experiment's own temperature and top_p (an episode keeps
    them, and the episodes rated together must share them); on the OpenAI routes the id goes in the
    X-Episode-Id header every other time."""
    episode_id = episodes.turn_id(experiment, turn)
    body["n"] = 1
    body.pop("temperature", None)
    body.pop("top_p", None)
    if case.path in OPENAI_PATHS and (turn // 5) % 2:
        body.pop("episode_id", None)
        case.headers = {**(case.headers or {}), "X-Episode-Id": episode_id}
    else:
        body["episode_id"] = episode_id


def shape(case: schemathesis.Case, turn: int, sizes: dict[str, int], names: list[str],
          episodes: Episodes | None = None) -> None:
    """Valid data fitted to what the schema cannot state, so that more of it gets past the rules between
    fields and the server's limits to the sampler and the learner: an experiment the test server can hold
    (rank at most its max_lora_rank, the model's own layers); exactly one prompt field; feedback for a group
    that was sampled (`sizes`: group id -> completions) with one reward per completion; an experiment that
    exists (`names`) for the OpenAI routes and, now and then, for a path; OpenAI requests mostly without the
    fields we refuse unless neutral, their sampling fields within the native bounds and their prompt or
    history as the server takes it (`_fit_openai_prompt`). And the calls no schema makes likely: every third
    OpenAI call streamed (`stream: true`, with `stream_options.include_usage` half the time); with
    `episodes`, two in five completions calls (native and OpenAI) one turn of an episode, and two in five
    feedback calls the rating of episodes sampled so far (`episode_ids`, one reward each). Valid data only,
    and only by removing or adding optional fields or swapping a value for another valid one, so what was
    valid stays valid. One case in four is left as is."""
    if case.meta is None or case.meta.generation.mode != schemathesis.GenerationMode.POSITIVE or turn % 4 == 3:
        return
    path_name = (case.path_parameters or {}).get("name")
    if names and path_name is not None and path_name not in names and turn % 2 == 0 and case.method.upper() != "DELETE":
        case.path_parameters["name"] = names[turn % len(names)]
    body = case.body
    if not isinstance(body, dict):
        return
    prompts = [key for key in PROMPT_FIELDS if body.get(key) is not None]
    if case.path == "/v1/experiments":
        lora = body.get("lora")
        if isinstance(lora, dict):
            lora.pop("target_modules", None)
            if _is_count(lora.get("r")) and lora["r"] > 16:
                lora["r"] = 16  # the test server's max_lora_rank
    elif case.path.endswith("/feedback") and episodes is not None and turn % 5 in (1, 2) and \
            episodes.ready(case.path_parameters["name"], turn):
        body["episode_ids"] = episodes.ready(case.path_parameters["name"], turn)
        for key in [*PROMPT_FIELDS, "group_id", "completions", "extra_completions"]:
            body.pop(key, None)
        rewards = [r if _is_number(r) and abs(r) <= 1e9 else 1.0 for r in body["rewards"]]
        body["rewards"] = list(itertools.islice(itertools.cycle(rewards), len(body["episode_ids"])))
    elif case.path.endswith("/feedback"):
        group_id = body.get("group_id")
        if group_id not in sizes and sizes and turn % 2 == 0:
            group_id = body["group_id"] = sorted(sizes)[turn % len(sizes)]
        for key in ("completions", "extra_completions"):
            for completion in body.get(key) or []:  # exactly one of text and token_ids
                if isinstance(completion, dict) and completion.get("text") is None:
                    completion["text"] = "An answer"
                if isinstance(completion, dict):
                    completion.pop("token_ids", None)
        if group_id in sizes:
            for key in prompts + ["completions"]:
                body.pop(key, None)
        size = sizes[group_id] + len(body.get("extra_completions") or []) if group_id in sizes else \
            len(body.get("completions") or []) or len(body["rewards"])
        rewards = [r if _is_number(r) and abs(r) <= 1e9 else 1.0 for r in body["rewards"]]  # the server's range
        body["rewards"] = list(itertools.islice(itertools.cycle(rewards), size))
        if group_id not in sizes and len(prompts) > 1:
            for key in prompts[1:]:
                body.pop(key)
    elif case.path.endswith("/completions") and case.path.startswith("/v1/experiments/") or \
            case.path == "/v1/tokenize":
        if not prompts:
            body["prompt"] = "Once upon a time"
        for key in prompts[1:]:
            body.pop(key)
        if case.path != "/v1/tokenize":
            body.pop("episode_id", None)  # an episode's turn where `episodes` makes it one
            if episodes is not None and turn % 5 in (1, 2):
                _as_episode_turn(case, body, case.path_parameters["name"], turn, episodes)
    elif case.path in OPENAI_PATHS:
        for key in [k for k in body if k not in OPENAI_HONOURED]:
            body.pop(key)
        for key in [k for k in AS_NATIVE if k in body and not _fits_native(k, body[k])]:
            body.pop(key)  # beyond the native bounds: a 422 before sampling, for the most part
        _fit_openai_prompt(body)
        if names and isinstance(body.get("model"), str) and body["model"] not in names:
            body["model"] = names[turn % len(names)]
        body.pop("episode_id", None)
        if turn % 3 == 1:
            body["stream"] = True
            if turn % 2:
                body["stream_options"] = {"include_usage": True}
        if episodes is not None and turn % 5 in (1, 2) and isinstance(body.get("model"), str):
            _as_episode_turn(case, body, body["model"], turn, episodes)
