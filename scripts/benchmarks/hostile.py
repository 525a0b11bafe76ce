"""The hostile-tenant round (issue 46): one key floods the Tinker API and the adapter downloads; another key's
native completions and feedback must stay within 2x of their figures alone, and every group it had acknowledged
(202) must be trained.

    scripts/bench --only hostile --no-markdown --out runs/bench-hostile.json    # the embedded SmolLM2
    .venv/bin/python -m scripts.benchmarks.hostile [--tiny] [--requests 20] [--out FILE]

On a server of its own (scripts/benchmarks/server.py's `start`, the server's defaults), two experiments with keys of
their own: `victim`, whose client loops completion + feedback one after another (random rewards, batch_groups 2:
its learner steps run), and `hostile`, whose key floods with HOSTILE_CLIENTS threads for each of: Tinker `asample`
with `prompt_logprobs` on its own model's sampler, `forward_backward` + `optim_step` on its model, and
`GET /v1/experiments/hostile/adapter`; each thread calls again at once, or 50 ms after a refusal whatever its
Retry-After said (as fairness.py's noisy tenant). Phases: victim alone; victim during the
flood (REQUESTS rounds and more until WINDOW_S have passed); then the flood stops and the victim's groups are
waited for until every 202 is trained (or DRAIN_S pass).

Reported: the victim's completion and feedback latency (median, p90) alone and flooded, their ratios (target:
the medians within 2x), the hostile calls' answers by kind and status, and whether every 202 was trained.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import requests as http

from grpo_server.client import AsyncClient, GrpoServerError

from .fairness import latency_stats

REQUESTS = 20
N = 4
MAX_TOKENS = 8
BATCH_GROUPS = 2
HOSTILE_CLIENTS = 4  # threads per kind of flood
WINDOW_S = 30.0
DRAIN_S = 300.0
TARGET = 2.0
RETRY_S = 0.05  # a refused hostile call is sent again after this, not after its Retry-After
VICTIM_KEY = "victim-tenant-key-3c1d9e7a"
HOSTILE_KEY = "hostile-tenant-key-8b2f6d40"


async def victim_rounds(client: AsyncClient, count: int, at_least_s: float = 0.0) -> dict:
    """`count` rounds of completion + feedback one after another, and more until `at_least_s` have passed."""
    complete, feedback, rated, i = [], [], 0, 0
    until, rng = time.monotonic() + at_least_s, random.Random(count)
    while i < count or time.monotonic() < until:
        i += 1
        asked = time.perf_counter()
        try:
            group = await client.complete("victim", prompt=f"Name a colour, number {i}.", n=N, max_tokens=MAX_TOKENS)
        except GrpoServerError as exc:  # back-pressure counts: the victim waits it out as a client would
            if exc.status != 429:
                raise
            await asyncio.sleep(exc.retry_after or 1.0)
            continue
        complete.append(time.perf_counter() - asked)
        asked = time.perf_counter()
        answer = await client.feedback("victim", group.group_id, [rng.random() for _ in group.completions])
        feedback.append(time.perf_counter() - asked)
        rated += answer.skipped is None
    return {"completion": latency_stats(complete), "feedback": latency_stats(feedback), "accepted": rated}


def _flood(url: str, model_dir: str, stop: threading.Event, answers: Counter, lock: threading.Lock) -> list:
    """The hostile key's threads (started here, joined by the caller once `stop` is set)."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=f"tml-{HOSTILE_KEY}")
    training = service.create_lora_training_client(base_model=model_dir, rank=8).result()
    tokens = [100 + (7 * i) % 900 for i in range(48)]  # any ids of the vocabulary: no tokenizer to load
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    sampler = training.save_weights_and_get_sampling_client().result()

    def count(key: str) -> None:
        with lock:
            answers[key] += 1

    def loop(kind: str, call) -> None:
        while not stop.is_set():
            try:
                call()
                count(f"{kind} ok")
            except Exception as exc:  # noqa: BLE001 - a refused call is counted, and the flood goes on
                count(f"{kind} {type(exc).__name__}: {str(exc)[:60]}")
                time.sleep(RETRY_S)  # at once again, whatever Retry-After said (as fairness.py's noisy tenant)

    def sample() -> None:
        sampler.sample(types.ModelInput.from_ints(tokens[:32]), 4, types.SamplingParams(max_tokens=MAX_TOKENS),
                       include_prompt_logprobs=True).result()

    train_lock = threading.Lock()  # forward_backward then optim_step, as a training client does

    def train() -> None:
        with train_lock:
            training.forward_backward([datum], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-4)).result()

    def download() -> None:
        answer = http.get(f"{url}/v1/experiments/hostile/adapter", headers={"Authorization": f"Bearer {HOSTILE_KEY}"},
                          timeout=120)
        if answer.status_code != 200:
            raise RuntimeError(f"HTTP {answer.status_code}")

    threads = [threading.Thread(target=loop, args=(kind, call), daemon=True)
               for kind, call in (("asample", sample), ("train", train), ("download", download))
               for _ in range(HOSTILE_CLIENTS)]
    for thread in threads:
        thread.start()
    return [service, *threads]


async def hostile_figure(url: str, admin_key: str, model_dir: str, *, requests: int = REQUESTS,
                         window_s: float = WINDOW_S) -> dict:
    async with AsyncClient(url, admin_key, timeout_s=900) as admin:
        await admin.create_experiment({"name": "victim", "api_key": VICTIM_KEY,
                                       "sampling": {"n": N, "max_tokens": MAX_TOKENS},
                                       "algorithm": {"batch_groups": BATCH_GROUPS}})
        await admin.create_experiment({"name": "hostile", "api_key": HOSTILE_KEY, "lora": {"r": 8},
                                       "sampling": {"n": N, "max_tokens": MAX_TOKENS}})
    async with AsyncClient(url, VICTIM_KEY, timeout_s=900) as victim:
        await victim_rounds(victim, 3)  # warm-up: an experiment's first requests are slow
        alone = await victim_rounds(victim, requests)
        stop, answers, lock = threading.Event(), Counter(), threading.Lock()
        started = await asyncio.to_thread(_flood, url, model_dir, stop, answers, lock)
        try:
            await asyncio.sleep(5)  # the flood under way
            window_start = time.monotonic()
            flooded = await victim_rounds(victim, requests, window_s)
            window = time.monotonic() - window_start
        finally:
            stop.set()
            service, threads = started[0], started[1:]
            for thread in threads:
                await asyncio.to_thread(thread.join, 120)
            await asyncio.to_thread(service.close, "success")
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
    ratios = {kind: round(flooded[kind]["median_s"] / alone[kind]["median_s"], 3) for kind in ("completion",
                                                                                                 "feedback")}
    met = all(r <= TARGET for r in ratios.values()) and trained_all
    return {"ratio_completion_median": ratios["completion"], "ratio_feedback_median": ratios["feedback"],
            "every_202_trained": trained_all, "met": met, "target": TARGET,
            "victim": {"alone": alone, "flooded": flooded, "window_s": round(window, 1),
                       "counters": counters.model_dump(), "errors": status.errors[-3:]},
            "hostile": {"threads_per_kind": HOSTILE_CLIENTS, "answers": dict(answers.most_common())},
            "requests": requests, "n": N, "max_tokens": MAX_TOKENS, "batch_groups": BATCH_GROUPS}


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
        result = await hostile_figure(handle.url, handle.api_key, str(model_dir), **kwargs)
    finally:
        code = await stop(handle)
    if code == 0 and not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {**result, "sampler_settings": sampler, "server_exit_code": code,
            "run_dir": str(run_dir) if keep or code else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tests/tiny_model.py's model (else the embedded SmolLM2)")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="the victim's rounds per phase")
    parser.add_argument("--window", type=float, default=WINDOW_S, help="least seconds of the flooded phase")
    parser.add_argument("--keep", action="store_true", help="keep the server's run directory (its logs)")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from .host import print_result
    from .server import standalone

    model_dir, _ = standalone(args, "hostile")
    result = asyncio.run(own_server_figure(model_dir, None, args.keep, requests=args.requests, window_s=args.window))
    print_result({"model": str(model_dir), **result}, args.out)


if __name__ == "__main__":
    main()
