"""The chaos soak's load (scripts/benchmarks/chaos.py): clients of every API family at once, each writing what it
asked and what it was answered into one `History`, which the checker (chaos_check.py) reads afterwards.

Clients, each a loop until the soak's end, pausing as the server asks (Retry-After) and after a lost connection:
- `native`: a group of n completions, then its rewards (never all equal, so it is trained, not skipped). A feedback
  whose answer was lost (connection, 5xx) is sent again until it is answered: 202, or 409 `duplicate_feedback` (an
  earlier try was accepted), or 404 (the group is gone: the front end restarted). Its id is then `acknowledged`,
  or `unknown` (it may or may not have been taken: the checker allows either, never twice);
- `episodes`: two episodes of two OpenAI chat turns each (one streamed, one not), rated as a group;
- `responses`: two single-turn Responses episodes, rated as a group;
- `tinker`: a Tinker model through the official SDK: SFT steps (`forward_backward`, `optim_step`), now and then
  `save_weights_for_sampler` with a sample from those weights, and `save_state`. Its answered steps, and the
  rollbacks the server names, are what the checker holds the model's ledger to;
- `churn`: an experiment created, sampled and rated once, and deleted, again and again, while the others train.
  Its archive's ledger is read for the checker (`archived_ledgers`) at once, before the server's `archives_kept`
  removes the archive (a soak's churn made 85 of them in 30 minutes, 1.8 GB when they were kept for ever).

Every record: `t` (seconds since the soak began), `client`, `family`, `op`, `experiment`, `status` (the HTTP
status, or `lost` when no answer came), `code`, `retry_after`, and what the op names (`group_id`, `version`, ...).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import openai

os.environ.setdefault("TINKER_TELEMETRY", "0")  # before the SDK is imported: nothing leaves this box
import tinker  # noqa: E402 - imported here, once, not on the clients' threads (two first imports at once broke httpx)
from tinker import types  # noqa: E402

from grpo_server.client import AsyncClient, GrpoServerError
from grpo_server.protocol import archive
from learner import ledger

N = 4  # completions a group, turns' episodes a rating
MAX_TOKENS = 6
REQUEST_TIMEOUT_S = 120.0  # a call still unanswered after this is `lost` (a paused worker holds it meanwhile)
PAUSE_AFTER_LOST_S = 0.5


class History:
    """What every client asked and was answered, in order, kept in memory and (when `path` is given) as JSON lines."""

    def __init__(self, path: Path | None = None) -> None:
        self.started = time.monotonic()
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._file = open(path, "w") if path is not None else None

    def add(self, **record: Any) -> dict[str, Any]:
        record = {"t": round(time.monotonic() - self.started, 3), **record}
        with self._lock:
            self.records.append(record)
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _answer_of(exc: BaseException) -> dict[str, Any]:
    """A failed call's record fields: its status, code and Retry-After, or `lost` for no answer at all."""
    if isinstance(exc, GrpoServerError):
        return {"status": exc.status, "code": exc.code, "retry_after": exc.retry_after}
    status = getattr(exc, "status_code", None) or getattr(exc, "status", None)
    if isinstance(status, int):
        body = getattr(exc, "body", None)
        code = body.get("code") if isinstance(body, dict) else None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            code = body["error"].get("code")
        response = getattr(exc, "response", None)
        retry = response.headers.get("retry-after") if response is not None else None
        return {"status": status, "code": code, "retry_after": retry}
    return {"status": "lost", "code": type(exc).__name__, "message": str(exc)[:200]}


def _wait_s(answer: dict[str, Any]) -> float:
    retry = answer.get("retry_after")
    try:
        return min(float(retry), 5.0) if retry is not None else PAUSE_AFTER_LOST_S
    except ValueError:
        return PAUSE_AFTER_LOST_S


class Load:
    """Every client of the soak, against the server at `url` (which the harness may restart under them)."""

    def __init__(self, url: str, admin_key: str, experiments: list[str], history: History, seed: int,
                 tinker_base_model: str | None, stop: asyncio.Event, run_dir: Path | None = None) -> None:
        self.url, self.admin_key, self.experiments = url, admin_key, experiments
        self.history, self.stop, self.tinker_base_model = history, stop, tinker_base_model
        self.rng = random.Random(seed)
        self.run_dir = run_dir  # where the churned experiments' archives are read (None: not read)
        self.archived_ledgers: dict[str, list[dict[str, Any]]] = {}  # archive label -> its ledger's timeline
        self.churned = 0
        self.tinker_op = None  # the Tinker call in flight (said if it never returns)

    async def run(self) -> None:
        tasks = []
        for name in self.experiments:
            tasks += [self.native(name), self.episodes(name, "chat"), self.episodes(name, "responses")]
        tasks.append(self.churn())
        tinker_thread = None
        if self.tinker_base_model is not None:  # a thread of its own: a call that never returns cannot hold the soak
            tinker_thread = threading.Thread(target=self.tinker, args=(self.rng.randrange(2**31),), daemon=True,
                                             name="chaos-tinker")
            tinker_thread.start()
        await asyncio.gather(*tasks)
        if tinker_thread is not None:
            await asyncio.to_thread(tinker_thread.join, REQUEST_TIMEOUT_S + 30)
            if tinker_thread.is_alive():  # a Tinker call unanswered past every timeout: a future that never ended
                self.record(client="tinker", family="tinker", op="hung", status="lost", code="no_answer",
                            message=f"the Tinker client's {self.tinker_op} did not return")

    def record(self, **fields: Any) -> dict[str, Any]:
        return self.history.add(**fields)

    # --- native groups ------------------------------------------------------------------------------------------

    async def native(self, name: str) -> None:
        async with AsyncClient(self.url, self.admin_key, timeout_s=REQUEST_TIMEOUT_S) as client:
            while not self.stop.is_set():
                try:
                    group = await client.complete(name, prompt=f"Count to {self.rng.randrange(100)}", n=N,
                                                  max_tokens=MAX_TOKENS)
                except (GrpoServerError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    answer = self.record(client="native", family="native", op="complete", experiment=name,
                                         **_answer_of(exc))
                    await asyncio.sleep(_wait_s(answer))
                    continue
                self.record(client="native", family="native", op="complete", experiment=name, status=200,
                            group_id=group.group_id, version=group.policy_version)
                rewards = [float(i % 2) for i in range(N)]
                self.rng.shuffle(rewards)
                await self.rate(name, lambda: client.feedback(name, group.group_id, rewards), "native",
                                group_id=group.group_id)

    async def rate(self, name: str, call, family: str, group_id: str | None = None) -> None:
        """`call` (a feedback) until it is answered; the outcome recorded as `acknowledged`, `unknown` or
        `refused` (a 4xx the request deserved: nothing was taken)."""
        lost = False
        while True:
            try:
                answer = await call()
            except GrpoServerError as exc:
                if exc.status in (429, 503):  # not taken (a 503: the journal write failed, or a restart): again
                    self.record(client=family, family=family, op="feedback", experiment=name, group_id=group_id,
                                **_answer_of(exc))
                    await asyncio.sleep(_wait_s(_answer_of(exc)))
                    if self.stop.is_set() and exc.status == 503:
                        break
                    continue
                outcome = ("acknowledged" if exc.code == "duplicate_feedback" and lost
                           else "unknown" if lost else "refused")
                self.record(client=family, family=family, op="feedback", experiment=name, group_id=group_id,
                            outcome=outcome, **_answer_of(exc))
                return
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                lost = True
                self.record(client=family, family=family, op="feedback", experiment=name, group_id=group_id,
                            **_answer_of(exc))
                await asyncio.sleep(PAUSE_AFTER_LOST_S)
                if self.stop.is_set():
                    break
                continue
            self.record(client=family, family=family, op="feedback", experiment=name, status=202,
                        group_id=answer.group_id, skipped=answer.skipped, outcome="acknowledged",
                        retried=lost)
            return
        self.record(client=family, family=family, op="feedback", experiment=name, group_id=group_id,
                    status="lost", outcome="unknown", code="soak_ended")

    # --- episodes over OpenAI chat and Responses ----------------------------------------------------------------

    async def episodes(self, name: str, api: str) -> None:
        family = "openai" if api == "chat" else "responses"
        async with AsyncClient(self.url, self.admin_key, timeout_s=REQUEST_TIMEOUT_S) as native:
            oai = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.admin_key, max_retries=0,
                                     timeout=REQUEST_TIMEOUT_S)
            try:
                while not self.stop.is_set():
                    ids = [uuid.uuid4().hex for _ in range(2)]
                    turns = 2 if api == "chat" else 1
                    if not await self._episode_turns(oai, name, family, api, ids, turns):
                        continue
                    await self.rate(name, lambda: native.rate_episodes(name, ids, [1.0, 0.0]), family)
            finally:
                await oai.close()

    async def _episode_turns(self, oai, name: str, family: str, api: str, ids: list[str], turns: int) -> bool:
        """Every turn of the episodes `ids`; False (after a pause) as soon as one is not answered: those episodes
        are left to expire, and new ones begin."""
        for turn in range(turns):
            for i, episode_id in enumerate(ids):
                stream = (turn + i) % 2 == 1
                try:
                    if api == "chat":
                        messages = [{"role": "user", "content": f"Say {self.rng.randrange(100)}"}]
                        out = await oai.chat.completions.create(
                            model=name, messages=messages, max_tokens=MAX_TOKENS, stream=stream,
                            extra_body={"episode_id": episode_id})
                        if stream:
                            async for _ in out:
                                pass
                    else:
                        await oai.responses.create(model=name, input=f"Name {self.rng.randrange(100)}",
                                                   max_output_tokens=MAX_TOKENS, extra_body={"episode_id": episode_id})
                except Exception as exc:  # noqa: BLE001 - every failure is recorded; the soak goes on
                    answer = self.record(client=family, family=family, op="turn", experiment=name,
                                         episode_id=episode_id, stream=stream, **_answer_of(exc))
                    await asyncio.sleep(_wait_s(answer))
                    return False
                self.record(client=family, family=family, op="turn", experiment=name, episode_id=episode_id,
                            stream=stream, status=200)
        return True

    # --- experiments created and deleted ----------------------------------------------------------------------

    async def churn(self) -> None:
        async with AsyncClient(self.url, self.admin_key, timeout_s=REQUEST_TIMEOUT_S) as client:
            while not self.stop.is_set():
                name = f"churn-{self.churned}"
                self.churned += 1
                try:
                    await client.create_experiment({"name": name, "sampling": {"n": N, "max_tokens": MAX_TOKENS},
                                                    "algorithm": {"batch_groups": 1}})
                    self.record(client="churn", family="native", op="create", experiment=name, status=201)
                    group = await client.complete(name, prompt="Churn", n=N, max_tokens=MAX_TOKENS)
                    answer = await client.feedback(name, group.group_id, [0.0, 1.0] * (N // 2))
                    self.record(client="churn", family="native", op="feedback", experiment=name, status=202,
                                group_id=answer.group_id, outcome="acknowledged", skipped=answer.skipped)
                except (GrpoServerError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    answer = self.record(client="churn", family="native", op="churn", experiment=name,
                                         **_answer_of(exc))
                    await asyncio.sleep(_wait_s(answer))
                await self._delete(client, name)
                await asyncio.sleep(self.rng.uniform(1, 4))

    async def _delete(self, client: AsyncClient, name: str) -> None:
        for _ in range(60):  # until it is gone: a delete refused while the server restarts is tried again
            try:
                await client.delete_experiment(name)
                self.record(client="churn", family="native", op="delete", experiment=name, status=200)
                await asyncio.to_thread(self._read_archives, name)
                return
            except GrpoServerError as exc:
                self.record(client="churn", family="native", op="delete", experiment=name, **_answer_of(exc))
                if exc.status == 404:
                    return
                await asyncio.sleep(_wait_s(_answer_of(exc)))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                self.record(client="churn", family="native", op="delete", experiment=name, **_answer_of(exc))
                await asyncio.sleep(1)

    def _read_archives(self, name: str) -> None:
        """The just-deleted experiment's ledger, read before the server's `archives_kept` removes its archive."""
        if self.run_dir is None:
            return
        for label in archive.labels(self.run_dir, name):
            folder = archive.folder(self.run_dir, label)
            self.archived_ledgers[f"archive/{label}"] = ledger.timeline(ledger.read(folder / "checkpoints"))

    # --- a Tinker model through the official SDK ------------------------------------------------------------------

    def tinker(self, seed: int) -> None:
        """On a thread (the SDK's calls block). Each failed call is recorded and the loop goes on; a call that
        fails naming a rollback moves the step the client expects back to the one it names."""
        rng = random.Random(seed)
        client = training = None
        model_id, steps = None, 0
        while not self.stop.is_set():
            op = "create"
            try:
                if training is None:
                    client = tinker.ServiceClient(base_url=self.url, api_key=f"tml-{self.admin_key}")
                    training = client.create_lora_training_client(base_model=self.tinker_base_model,
                                                                  rank=8).result(timeout=REQUEST_TIMEOUT_S)
                    model_id = training.model_id
                    self.record(client="tinker", family="tinker", op="create", model_id=model_id, status=200)
                    tokens = list(range(5, 13))  # ids every model has: no tokenizer needed on this side
                    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                        loss_fn_inputs={"target_tokens": tokens[1:],
                                                        "weights": [1.0] * (len(tokens) - 1)})
                op = self.tinker_op = "forward_backward"
                training.forward_backward([datum], "cross_entropy").result(timeout=REQUEST_TIMEOUT_S)
                op = self.tinker_op = "optim_step"
                training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=REQUEST_TIMEOUT_S)
                steps += 1
                self.record(client="tinker", family="tinker", op="optim_step", model_id=model_id, status=200,
                            step=steps)
                if rng.random() < 0.3:
                    op = self.tinker_op = "save_weights_for_sampler"
                    path = training.save_weights_for_sampler(f"s{steps % 3}").result(timeout=REQUEST_TIMEOUT_S).path
                    op = self.tinker_op = "sample"
                    sampler = client.create_sampling_client(model_path=path)
                    if hasattr(sampler, "result"):  # a future of the client in this SDK
                        sampler = sampler.result(timeout=REQUEST_TIMEOUT_S)
                    sampler.sample(datum.model_input, 2, types.SamplingParams(max_tokens=3)).result(
                        timeout=REQUEST_TIMEOUT_S)
                    self.record(client="tinker", family="tinker", op="save_and_sample", model_id=model_id,
                                status=200, step=steps)
                if rng.random() < 0.1:
                    op = self.tinker_op = "save_state"
                    training.save_state(f"state-{steps}-{rng.randrange(10**6)}").result(timeout=REQUEST_TIMEOUT_S)
                    self.record(client="tinker", family="tinker", op="save_state", model_id=model_id, status=200)
            except Exception as exc:  # noqa: BLE001 - every failure is recorded; the soak goes on
                message = str(exc)
                rolled = _rolled_back_to(message)
                if rolled is not None:
                    steps = rolled
                self.record(client="tinker", family="tinker", op=op,
                            model_id=model_id, status=getattr(exc, "status_code", None) or "failed",
                            code=type(exc).__name__, message=message[:300], rolled_back_to=rolled, step=steps)
                time.sleep(1.0)
        self.record(client="tinker", family="tinker", op="end", model_id=model_id, status=200, step=steps)
        if client is not None:
            try:
                client.close("success").result(timeout=30)
            except Exception:  # noqa: BLE001 - the server may be restarting at the very end
                pass


def _rolled_back_to(message: str) -> int | None:
    """The step a `rolled_back` error names (grpo_server/api/tinker/service.py `rollback`), if it names one."""
    import re

    found = re.search(r"rolled back from optimizer step \d+ to step (\d+)", message)
    return int(found.group(1)) if found else None
