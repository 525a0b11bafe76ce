"""The hostile-tenant round (issues 46 and 57): one key floods the server with every attack we know of; another
key's native completions and feedback must stay within 2x of their figures alone, the front end must stay small
and responsive, and every group the other key had acknowledged (202) must be trained.

    scripts/bench --quick --only hostile --out runs/bench-hostile.json    # the embedded SmolLM2
    .venv/bin/python -m scripts.benchmarks.hostile [--tiny] [--requests 20] [--window 30] [--out FILE]

On a server of its own (scripts/benchmarks/server.py's `start`, the server's defaults), two experiments with keys of
their own: `victim`, whose client loops completion + feedback one after another (random rewards, batch_groups 2:
its learner steps run), and `hostile`, whose key floods with threads of each kind (THREADS), each calling again at
once, or 50 ms after a refusal whatever its Retry-After said (as fairness.py's noisy tenant). The threads run in a
process of their own (FLOOD_PROCESS), as another client's would:
- `asample`: Tinker asample of 4 sequences with `prompt_logprobs` on its own model's sampler (the SDK);
- `train`: `forward_backward` + `optim_step` on its model (the SDK);
- `download`: `GET /v1/experiments/hostile/adapter`;
- `asample64`: raw asample calls of `num_samples` = max_n (64), more threads than tinker_max_samples_per_key
  (1024) admits at once;
- `csr`: a ~3 KB protobuf forward_backward of 16 empty 16 x 2^20 CSR tensors (268M values dense), whose future
  must fail `over_limit`;
- `decode`: a ~6 MiB valid-shaped protobuf forward_backward (1,024 datums of 256 chunks and 16 small loss
  inputs) on its own model: the body is decoded (seconds of CPU each), then refused by the token bound;
- `names`: `save_weights_for_sampler` with a 10 KB name, which must be a 422;
- `stream`: OpenAI chat completions with `stream: true` and `n` = max_n on the hostile experiment, whose served
  weights were first trained (a few Tinker SFT steps, then pushed) to answer with a special token over and over
  (`<|im_start|>`, which decodes to nothing): each choice a run of tokens that make no text, which streaming
  once re-decoded from the start of the choice on the event loop. What the streams held is counted.
Phases: victim alone; the hostile model primed and the flood started; victim during the flood (REQUESTS rounds and
more until WINDOW_S have passed, none begun after FLOODED_AT_MOST_S: a starved victim ends the phase with fewer);
then the flood stops and the victim's groups are waited for until every 202 is trained (or DRAIN_S pass).
Throughout, the front end's VmRSS every 0.5 s (`grpo-server serve`'s own process) and GET /v1/health's
`event_loop_lag_max_s` (the server's own, over its last minute) every second. A front end that grows more than
SAFETY_RSS_MIB stops the decode flood (the box has no swap and is shared); the result says when.

Reported: the victim's completion and feedback latency (median, p90) alone and flooded and their ratios (target:
the medians within 2x), the front end's RSS before the flood and its peak (target: growth under 200 MiB), the
largest event_loop_lag_max_s during the flood (target: under 0.25 s), the hostile calls' answers by kind and
status, what the streams held, and whether every 202 was trained.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import struct
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import requests as http

from grpo_server.client import AsyncClient, GrpoServerError

from .fairness import latency_stats
from .host import rss_mib

REQUESTS = 20
N = 4
MAX_TOKENS = 8
BATCH_GROUPS = 2
HOSTILE_CLIENTS = 4  # threads per kind of the first flood (asample, train, download)
# threads per kind of the attacks of issue 57
THREADS = {"asample64": 20, "csr": 2, "decode": 10, "names": 2, "stream": 2}
MAX_N = 64  # the server's max_n (config default): asample's num_samples and the streams' n
ASAMPLE_MAX_TOKENS = 16
STREAM_MAX_TOKENS = 256
SPECIAL_TOKEN = 1  # <|im_start|> of SmolLM2's tokenizer (the tiny model's too): decodes to nothing, stops nothing
PRIME_TOKENS = STREAM_MAX_TOKENS  # the special token's run in the SFT datum: as long as a streamed choice
PRIME_STEPS = 40  # at most, until the run's mean NLL is under PRIME_NLL
PRIME_NLL = 0.05
PRIME_LR = 5e-3
NAME_CHARS = 10 * 1024
WINDOW_S = 30.0
FLOODED_AT_MOST_S = 240.0  # the flooded phase ends after this even with fewer than REQUESTS rounds (a starved victim)
SAFETY_RSS_MIB = 3072.0  # past this growth the decode flood stops (a shared box has no swap): said in the result
DRAIN_S = 300.0
TARGET = 2.0
TARGET_RSS_MIB = 200.0  # the front end's growth, peak over before the flood
TARGET_LAG_S = 0.25  # event_loop_lag_max_s during the flood
RSS_EVERY_S = 0.5
LAG_EVERY_S = 1.0
RETRY_S = 0.05  # a refused hostile call is sent again after this, not after its Retry-After
VICTIM_KEY = "victim-tenant-key-3c1d9e7a"
HOSTILE_KEY = "hostile-tenant-key-8b2f6d40"
PROTO = "application/x-protobuf"
HEADERS = {"X-API-Key": f"tml-{HOSTILE_KEY}", "Authorization": f"Bearer {HOSTILE_KEY}"}


async def victim_rounds(client: AsyncClient, count: int, at_least_s: float = 0.0,
                        at_most_s: float = float("inf")) -> dict:
    """`count` rounds of completion + feedback one after another, and more until `at_least_s` have passed; none
    begun after `at_most_s`."""
    complete, feedback, rated, i, errors = [], [], 0, 0, Counter()
    began, rng = time.monotonic(), random.Random(count)
    while (i < count or time.monotonic() < began + at_least_s) and time.monotonic() < began + at_most_s:
        i += 1
        asked = time.perf_counter()
        try:
            group = await client.complete("victim", prompt=f"Name a colour, number {i}.", n=N, max_tokens=MAX_TOKENS)
        except GrpoServerError as exc:
            if exc.status == 429:  # back-pressure counts: the victim waits it out as a client would
                await asyncio.sleep(exc.retry_after or 1.0)
                continue
            if exc.status < 500:
                raise
            # A 5xx (a worker that did not answer in time): counted, and the time waited for nothing is the round's
            # completion latency, so a starved victim's median is not made of its lucky rounds only.
            errors[f"{exc.status} {exc.code}"] += 1
            complete.append(time.perf_counter() - asked)
            continue
        complete.append(time.perf_counter() - asked)
        asked = time.perf_counter()
        answer = await client.feedback("victim", group.group_id, [rng.random() for _ in group.completions])
        feedback.append(time.perf_counter() - asked)
        rated += answer.skipped is None
    return {"completion": latency_stats(complete), "feedback": latency_stats(feedback) if feedback else None,
            "accepted": rated, "errors": dict(errors)}


# --- protobuf bodies (the SDK's own classes, as tests/test_tinker_bounds.py) -------------------------------------

def _tokens(pb, values: list[int]):
    return pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=struct.pack(f"<{len(values)}i", *values)))


def _dense(pb, values: list[float]):
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[len(values)], dense=struct.pack(f"<{len(values)}f", *values))


def csr_body(model_id: str) -> bytes:
    """16 empty 16 x 2^20 CSR tensors: ~3 KB on the wire, 268M values dense."""
    from tinker.proto import tinker_public_pb2 as pb

    def empty_csr(rows: int, cols: int):
        return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[rows, cols], sparse_csr=pb.SparseCsr(
            values=b"", crow_indices=struct.pack(f"<{rows + 1}q", *([0] * (rows + 1))), col_indices=b""))
    datum = pb.Datum(model_input=[_tokens(pb, [1, 2, 3])],
                     loss_fn_inputs={f"input{i}": empty_csr(16, 2**20) for i in range(16)})
    return pb.ForwardBackwardRequest(model_id=model_id, data=[datum], loss_fn="cross_entropy").SerializeToString()


def decode_body(model_id: str) -> bytes:
    """~6 MiB: 1,024 datums (the count bound) of 256 chunks and 16 loss inputs (the input bound) each."""
    from tinker.proto import tinker_public_pb2 as pb

    heavy = pb.Datum(model_input=[_tokens(pb, [1, 2, 3, 4])] * 256,
                     loss_fn_inputs={f"x{i}": _dense(pb, [1.0] * 4) for i in range(16)})
    return pb.ForwardBackwardRequest(model_id=model_id, data=[heavy] * 1024,
                                     loss_fn="cross_entropy").SerializeToString()


# --- the flood ----------------------------------------------------------------------------------------------------

class Refused(Exception):
    """A hostile call the server refused or failed: its label is what is counted."""


def _error_code(answer: http.Response) -> str:
    try:
        return answer.json()["error"]["code"]
    except Exception:  # noqa: BLE001 - a body that is not our error shape
        return answer.text[:40]


def _outcome(session: http.Session, url: str, request_id: str) -> str:
    """A raw call's future: 'ok' for a result, else its error's code (long-polled as the SDK does)."""
    while True:
        answer = session.post(f"{url}/api/v1/retrieve_future", json={"request_id": request_id}, headers=HEADERS,
                              timeout=600)
        if answer.status_code == 408:
            continue
        if answer.status_code != 200:
            raise Refused(f"future HTTP {answer.status_code} {_error_code(answer)}")
        if answer.headers.get("Content-Type", "").startswith(PROTO):
            return "ok"
        body = answer.json()
        if isinstance(body, dict) and "error" in body and "category" in body:
            return str(body["error"]).split(":")[0].split()[0]
        return "ok"


def _submit(session: http.Session, url: str, path: str, **kwargs) -> str:
    answer = session.post(f"{url}{path}", headers={**HEADERS, **kwargs.pop("headers", {})}, timeout=600, **kwargs)
    if answer.status_code != 200:
        raise Refused(f"HTTP {answer.status_code} {_error_code(answer)}")
    return _outcome(session, url, answer.json()["request_id"])


def _chat(url: str, body: dict, stream: bool) -> http.Response:
    answer = http.post(f"{url}/v1/chat/completions", json={"model": "hostile", **body, "stream": stream},
                       headers={"Authorization": f"Bearer {HOSTILE_KEY}"}, timeout=900, stream=stream)
    if answer.status_code != 200:
        raise Refused(f"HTTP {answer.status_code} {_error_code(answer)}")
    return answer


STREAM_MESSAGES = [{"role": "user", "content": "Say anything you like."}]


def prime(training, url: str) -> dict:
    """A few Tinker SFT steps on the hostile model toward a run of SPECIAL_TOKEN after the streams' chat prompt (as
    the server renders it: its prompt_token_ids), until the run's mean NLL is under PRIME_NLL (or PRIME_STEPS)."""
    from tinker import types

    prompt = _chat(url, {"messages": STREAM_MESSAGES, "n": 1, "max_tokens": 1}, False).json()["prompt_token_ids"]
    tokens = [*prompt, *[SPECIAL_TOKEN] * PRIME_TOKENS]
    weights = [0.0] * (len(prompt) - 1) + [1.0] * PRIME_TOKENS
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})
    nll, steps, started = None, 0, time.monotonic()
    while steps < PRIME_STEPS and (nll is None or nll > PRIME_NLL):
        result = training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=PRIME_LR)).result()
        steps += 1
        nll = result.metrics["loss:sum"] / PRIME_TOKENS
    return {"steps": steps, "nll_per_token": round(nll, 4), "seconds": round(time.monotonic() - started, 1),
            "prompt_tokens": len(prompt), "special_token": SPECIAL_TOKEN}


class StreamTally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.streams = self.events = self.bytes = self.tokens = self.special = self.text_chars = 0
        self.choices = 0
        self.longest_s = 0.0

    def add(self, events: int, size: int, tokens: list[int], text_chars: int, choices: int, took: float) -> None:
        with self.lock:
            self.streams += 1
            self.events += events
            self.bytes += size
            self.tokens += len(tokens)
            self.special += sum(t == SPECIAL_TOKEN for t in tokens)
            self.text_chars += text_chars
            self.choices += choices
            self.longest_s = max(self.longest_s, took)

    def summary(self) -> dict:
        return {"streams": self.streams, "choices": self.choices, "events": self.events,
                "mib": round(self.bytes / 2**20, 1),
                "tokens": self.tokens, "special_tokens": self.special, "text_chars": self.text_chars,
                "special_share": round(self.special / self.tokens, 3) if self.tokens else None,
                "longest_s": round(self.longest_s, 1), "n": MAX_N, "max_tokens": STREAM_MAX_TOKENS}


def _flood(url: str, model_dir: str, stop: threading.Event, answers: Counter, lock: threading.Lock,
           info: dict, only: set[str] | None = None, guard: threading.Event | None = None) -> list:
    """The hostile key's threads (started here, joined by the caller once `stop` is set). `info` gets the priming's
    figures and, as they come, what the streams held."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=f"tml-{HOSTILE_KEY}")
    training = service.create_lora_training_client(base_model=model_dir, rank=8).result()
    info["priming"] = prime(training, url) if only is None or "stream" in only else None
    tokens = [100 + (7 * i) % 900 for i in range(48)]  # any ids of the vocabulary: no tokenizer to load
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    sampler = training.save_weights_and_get_sampling_client().result()  # the primed weights, served from now on
    model_id, sampling_session = training.model_id, sampler._sampling_session_id
    bodies = {"csr": csr_body(model_id), "decode": decode_body(model_id)}
    info["body_bytes"] = {kind: len(body) for kind, body in bodies.items()}
    tally = info["streams"] = StreamTally()
    local = threading.local()

    def session() -> http.Session:
        if not hasattr(local, "session"):
            local.session = http.Session()
        return local.session

    def count(key: str) -> None:
        with lock:
            answers[key] += 1

    def loop(kind: str, call) -> None:
        while not stop.is_set():
            if kind == "decode" and guard is not None and guard.is_set():
                return  # the front end grew past SAFETY_RSS_MIB
            try:
                count(f"{kind} {call()}")
            except Exception as exc:  # noqa: BLE001 - a refused call is counted, and the flood goes on
                label = str(exc)[:60] if isinstance(exc, Refused) else f"{type(exc).__name__}: {str(exc)[:60]}"
                count(f"{kind} {label}")
                time.sleep(RETRY_S)  # at once again, whatever Retry-After said (as fairness.py's noisy tenant)

    def sample() -> str:
        sampler.sample(types.ModelInput.from_ints(tokens[:32]), 4, types.SamplingParams(max_tokens=MAX_TOKENS),
                       include_prompt_logprobs=True).result()
        return "ok"

    train_lock = threading.Lock()  # forward_backward then optim_step, as a training client does

    def train() -> str:
        with train_lock:
            training.forward_backward([datum], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        return "ok"

    def download() -> str:
        answer = session().get(f"{url}/v1/experiments/hostile/adapter", headers=HEADERS, timeout=120)
        if answer.status_code != 200:
            raise Refused(f"HTTP {answer.status_code}")
        return "ok"

    def asample64() -> str:
        return _submit(session(), url, "/api/v1/asample", json={
            "sampling_session_id": sampling_session, "num_samples": MAX_N,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens[:16]}]},
            "sampling_params": {"max_tokens": ASAMPLE_MAX_TOKENS, "temperature": 1.0}})

    def forward_backward(kind: str) -> str:
        return _submit(session(), url, "/api/v1/forward_backward", data=bodies[kind],
                       headers={"Content-Type": PROTO})

    def names() -> str:
        answer = session().post(f"{url}/api/v1/save_weights_for_sampler", headers=HEADERS, timeout=120,
                                json={"model_id": model_id, "path": "n" * NAME_CHARS})
        if answer.status_code == 200:  # accepted: what it did is in its future
            return "accepted " + _outcome(session(), url, answer.json()["request_id"])
        if answer.status_code == 422:
            return f"422 {_error_code(answer)}"
        raise Refused(f"HTTP {answer.status_code} {_error_code(answer)}")

    def stream() -> str:
        started = time.monotonic()
        answer = _chat(url, {"messages": STREAM_MESSAGES, "n": MAX_N, "max_tokens": STREAM_MAX_TOKENS,
                             "return_token_ids": True}, True)
        events = size = text = 0
        ids: list[int] = []
        choices: set[int] = set()
        with answer:
            for line in answer.iter_lines():
                size += len(line) + 1
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise Refused(f"stream error {chunk['error'].get('code')}")
                events += 1
                for choice in chunk.get("choices", []):
                    choices.add(choice["index"])
                    ids.extend(choice.get("token_ids") or [])
                    text += len((choice.get("delta") or {}).get("content") or "")
        tally.add(events, size, ids, text, len(choices), time.monotonic() - started)
        return "ok"

    kinds = [("asample", sample, HOSTILE_CLIENTS), ("train", train, HOSTILE_CLIENTS),
             ("download", download, HOSTILE_CLIENTS), ("asample64", asample64, THREADS["asample64"]),
             ("csr", lambda: forward_backward("csr"), THREADS["csr"]),
             ("decode", lambda: forward_backward("decode"), THREADS["decode"]),
             ("names", names, THREADS["names"]), ("stream", stream, THREADS["stream"])]
    threads = [threading.Thread(target=loop, args=(kind, call), daemon=True, name=f"hostile-{kind}")
               for kind, call, count_ in kinds if only is None or kind in only for _ in range(count_)]
    for thread in threads:
        thread.start()
    return [service, *threads]


FLOOD_PROCESS = ("the hostile key's threads run in a process and session of their own (spawned): in the victim "
                 "client's process their GIL held its event loop back, and that was counted in the victim's latency")
FLOOD_START_S = 600.0  # the flood's process primes the hostile model first (a few SFT steps and a push)


def _flood_process(url: str, model_dir: str, only: set[str] | None, stop, guard, ready, results) -> None:
    """The flood (`_flood`) in a process of its own, until `stop`: its answers and figures go back on `results`. In a
    session of its own, as another client's would be: with the kernel's autogroups, processes of one session share
    one session's CPU, and the victim's client would share its share with the flood's 40-odd threads."""
    os.setsid()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    answers, lock, info = Counter(), threading.Lock(), {}
    started = _flood(url, model_dir, stop, answers, lock, info, only, guard)
    ready.set()
    stop.wait()
    service, threads = started[0], started[1:]
    for thread in threads:
        thread.join(300)
    service.close("success")
    with lock:
        info["streams"] = info["streams"].summary() if "streams" in info else None
        results.put((dict(answers), info))


class Flood:
    """The hostile key's flood in a spawned process (FLOOD_PROCESS): `started` once it floods, `stopped` for its
    answers by kind and what it saw."""

    def __init__(self, url: str, model_dir: str, only: set[str] | None, guard) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.stop, self.ready, self.results = context.Event(), context.Event(), context.Queue()
        self.process = context.Process(target=_flood_process, name="hostile-flood", daemon=True,
                                       args=(url, model_dir, only, self.stop, guard, self.ready, self.results))
        self.process.start()

    async def started(self) -> None:
        while not await asyncio.to_thread(self.ready.wait, 1.0):
            if not self.process.is_alive():
                raise RuntimeError(f"the flood's process ended with {self.process.exitcode} before flooding")

    async def stopped(self) -> tuple[Counter, dict]:
        self.stop.set()
        try:
            answers, info = await asyncio.to_thread(self.results.get, True, FLOOD_START_S)
        finally:
            await asyncio.to_thread(self.process.join, 60)
            if self.process.is_alive():
                self.process.kill()
        return Counter(answers), info


# --- the front end's memory and loop -----------------------------------------------------------------------------

async def watch_rss(pid: int, samples: list, stop: asyncio.Event, guard) -> None:
    """(monotonic time, VmRSS MiB) every RSS_EVERY_S until `stop`; `guard` set once it grew SAFETY_RSS_MIB over
    the first sample."""
    while not stop.is_set():
        value = rss_mib(pid)
        if value is not None:
            samples.append((time.monotonic(), value))
            if value - samples[0][1] > SAFETY_RSS_MIB and not guard.is_set():
                guard.set()
                samples.append((time.monotonic(), value, "guard"))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), RSS_EVERY_S)


async def watch_lag(client: AsyncClient, samples: list, stop: asyncio.Event) -> None:
    """(monotonic time, event_loop_lag_max_s, event_loop_lag_p99_s) every LAG_EVERY_S until `stop`."""
    while not stop.is_set():
        try:
            health = await client.health()
            samples.append((time.monotonic(), health.event_loop_lag_max_s, health.event_loop_lag_p99_s))
        except Exception:  # noqa: BLE001 - a health call that fails is a sample missed, said in the counts
            samples.append((time.monotonic(), None, None))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), LAG_EVERY_S)


async def hostile_figure(url: str, admin_key: str, model_dir: str, front_end_pid: int | None = None, *,
                         requests: int = REQUESTS, window_s: float = WINDOW_S, only: set[str] | None = None) -> dict:
    async with AsyncClient(url, admin_key, timeout_s=900) as admin:
        await admin.create_experiment({"name": "victim", "api_key": VICTIM_KEY,
                                       "sampling": {"n": N, "max_tokens": MAX_TOKENS},
                                       "algorithm": {"batch_groups": BATCH_GROUPS}})
        await admin.create_experiment({"name": "hostile", "api_key": HOSTILE_KEY, "lora": {"r": 8},
                                       "sampling": {"n": N, "max_tokens": MAX_TOKENS}})
        import multiprocessing

        # The flood's process stops its decode flood on this (SAFETY_RSS_MIB), so an Event it shares.
        watching, rss, lags, guard = asyncio.Event(), [], [], multiprocessing.get_context("spawn").Event()
        watchers = [asyncio.create_task(watch_lag(admin, lags, watching))]
        if front_end_pid is not None:
            watchers.append(asyncio.create_task(watch_rss(front_end_pid, rss, watching, guard)))
        try:
            result = await _phases(url, model_dir, requests, window_s, only, guard)
        finally:
            watching.set()
            await asyncio.gather(*watchers)
    set_up, flood_start, flood_end = result.pop("flood_span")
    guarded = [t for t, _, *mark in rss if mark]
    rss = [(t, v) for t, v, *mark in rss if not mark]
    before = [v for t, v in rss if t < flood_start]
    during = [v for t, v in rss if t >= flood_start]
    lag_alone = [m for t, m, _ in lags if t < set_up and m is not None]
    lag_flood = [(m, p) for t, m, p in lags if flood_start <= t <= flood_end and m is not None]
    rss_figure = None if not before or not during else {
        "before_mib": round(before[-1], 1), "peak_mib": round(max(during), 1),
        "growth_mib": round(max(during) - before[-1], 1), "after_mib": round(during[-1], 1), "samples": len(rss),
        "decode_flood_stopped_at_s": round(guarded[0] - flood_start, 1) if guarded else None,
        "safety_mib": SAFETY_RSS_MIB}
    lag_figure = {"alone_max_s": round(max(lag_alone), 4) if lag_alone else None,
                  "flood_max_s": round(max(m for m, _ in lag_flood), 4) if lag_flood else None,
                  "flood_p99_max_s": round(max(p for _, p in lag_flood), 4) if lag_flood else None,
                  "samples": len(lag_flood), "missed": sum(m is None for _, m, _ in lags)}
    ratios = result["ratios"]
    victim_errors = sum(result["victim"]["flooded"]["errors"].values())
    checks = {"completion": ratios["completion"] <= TARGET and not victim_errors,
              "feedback": ratios["feedback"] is not None and ratios["feedback"] <= TARGET,
              "rss": rss_figure is not None and rss_figure["growth_mib"] < TARGET_RSS_MIB,
              "loop_lag": lag_figure["flood_max_s"] is not None and lag_figure["flood_max_s"] < TARGET_LAG_S,
              "every_202_trained": result["every_202_trained"]}
    return {"ratio_completion_median": ratios["completion"], "ratio_feedback_median": ratios["feedback"],
            "every_202_trained": result["every_202_trained"], "front_end_rss": rss_figure, "loop_lag": lag_figure,
            "checks": checks, "met": all(checks.values()), "target": TARGET, "target_rss_mib": TARGET_RSS_MIB,
            "target_lag_s": TARGET_LAG_S, "victim": result["victim"], "hostile": result["hostile"],
            "requests": requests, "n": N, "max_tokens": MAX_TOKENS, "batch_groups": BATCH_GROUPS}


async def _phases(url: str, model_dir: str, requests: int, window_s: float, only: set[str] | None,
                  guard) -> dict:
    async with AsyncClient(url, VICTIM_KEY, timeout_s=900) as victim:
        await victim_rounds(victim, 3)  # warm-up: an experiment's first requests are slow
        alone = await victim_rounds(victim, requests)
        flood = Flood(url, model_dir, only, guard)
        set_up = time.monotonic()
        await flood.started()
        flood_start = time.monotonic()
        try:
            await asyncio.sleep(5)  # the flood under way
            window_start = time.monotonic()
            flooded = await victim_rounds(victim, requests, window_s, FLOODED_AT_MOST_S)
            window = time.monotonic() - window_start
        finally:
            answers, info = await flood.stopped()
        flood_end = time.monotonic()
        while (await victim.status("victim")).counters.groups_received % BATCH_GROUPS:
            await victim_rounds(victim, 1)  # a whole last batch: a lone group waits for its partner, by design
        deadline = time.monotonic() + DRAIN_S
        while True:
            status = await victim.status("victim")
            counters = status.counters
            # Acknowledged for training: every 202 but the zero-variance groups (no gradient) and the ones
            # max_staleness dropped by design (counted apart).
            owed = counters.groups_received - counters.groups_zero_variance - counters.groups_dropped_stale
            if counters.groups_trained >= owed or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
    trained_all = counters.groups_trained == owed
    ratios = {kind: round(flooded[kind]["median_s"] / alone[kind]["median_s"], 3) if flooded[kind] else None
              for kind in ("completion", "feedback")}
    return {"ratios": ratios, "every_202_trained": trained_all, "flood_span": (set_up, flood_start, flood_end),
            "victim": {"alone": alone, "flooded": flooded, "window_s": round(window, 1),
                       "counters": counters.model_dump(), "errors": status.errors[-3:]},
            "hostile": {"threads_per_kind": HOSTILE_CLIENTS, "threads": THREADS,
                        "answers": dict(sorted(answers.items())), "set_up_s": round(flood_start - set_up, 1),
                        "flood_s": round(flood_end - flood_start, 1), "priming": info.get("priming"),
                        "body_bytes": info.get("body_bytes"),
                        "streams": info.get("streams"), "flood_process": FLOOD_PROCESS,
                        "asample_max_tokens": ASAMPLE_MAX_TOKENS, "name_chars": NAME_CHARS,
                        "kinds": sorted(only) if only else "all"}}


async def own_server_figure(model_dir: Path, sampler_settings: dict | None = None, keep: bool = False,
                            **kwargs) -> dict:
    """The figure on a server started for it, then stopped."""
    from . import front_end
    from .server import start, stop

    run_dir = Path(tempfile.mkdtemp(prefix="bench-hostile-"))
    sampler = {**front_end.server_sampler_settings(SimpleNamespace(max_num_seqs=front_end.MAX_NUM_SEQS)),
               **(sampler_settings or {})}
    handle = await start(run_dir, model_dir, engine="vllm", max_model_len=1024, sampler=sampler,
                         learner={"zero_stage": 2})
    try:
        result = await hostile_figure(handle.url, handle.api_key, str(model_dir), handle.process.pid, **kwargs)
    finally:
        code = await stop(handle)
    if code == 0 and not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {**result, "sampler_settings": sampler, "server_exit_code": code,
            "run_dir": str(run_dir) if keep or code else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=REQUESTS, help="the victim's rounds per phase")
    parser.add_argument("--window", type=float, default=WINDOW_S, help="least seconds of the flooded phase")
    parser.add_argument("--kinds", default=None, help="only these kinds of flood, comma-separated (default all: "
                        "asample,train,download," + ",".join(THREADS) + ")")
    from .server import standalone, standalone_options

    standalone_options(parser, sampler=False)
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from .host import print_result

    model_dir, _ = standalone(args, "hostile")
    only = {k.strip() for k in args.kinds.split(",") if k.strip()} if args.kinds else None
    result = asyncio.run(own_server_figure(model_dir, None, args.keep, requests=args.requests, window_s=args.window,
                                           only=only))
    print_result({"model": str(model_dir), **result}, args.out)


if __name__ == "__main__":
    main()
