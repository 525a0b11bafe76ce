"""Overlap: completion tok/s through the server while the learner runs train steps back to back vs while it is idle.

The learner's train verb is called directly (on an experiment only the learner knows), so the server's
`schedule` does not keep sampling and training apart, as `alternate` does on a CPU host.
"""

from __future__ import annotations

import asyncio
from typing import Any

from grpo_server.client import AsyncClient
from grpo_server.config import AlgorithmConfig, LoraConfig
from grpo_server.protocol.wire import AdapterVersion, AddExperimentRequest, RemoveExperimentRequest, TrainMetrics

from .front_end import front_end_args, prompts, run_mix, server_request
from .push import train_request, verb, worker_session


async def overlap(client: AsyncClient, learner_url: str, name: str, group: Any, args, rounds: int,
                  trainee: str = "overlapbench") -> dict:
    """Completion tok/s through the server while the learner is idle vs while it trains, alternating
    (idle, busy, busy, idle, ...). "Busy": the learner's train verb in a loop on an experiment only the
    learner knows (so no push or checkpoint of the front end's experiments interferes), from one step
    before the busy round starts until it ends."""
    request = train_request(trainee, group.prompt_token_ids, group.completions)
    prompt_ids: list[list[int]] = [[] for _ in range(args.requests)]
    one = server_request(client, name, args, prompt_ids)
    totals = {"idle": [0, 0.0], "busy": [0, 0.0]}
    steps = 0
    async with worker_session() as session:  # the workers answer only calls with their secret
        await verb(session, learner_url, "add_experiment",
                   AddExperimentRequest(name=trainee, lora=LoraConfig(), algorithm=AlgorithmConfig()), AdapterVersion)
        try:
            await run_mix(one, min(2, args.requests), args.concurrency)  # warm-up
            for r in range(rounds):
                for side in (("idle", "busy") if r % 2 == 0 else ("busy", "idle")):
                    stop, training = asyncio.Event(), None
                    if side == "busy":
                        async def train_until_stopped() -> None:
                            nonlocal steps
                            while not stop.is_set():
                                await verb(session, learner_url, "train", request, TrainMetrics)
                                steps += 1
                        training = asyncio.create_task(train_until_stopped())
                        await asyncio.sleep(1.0)  # the first step is under way
                    try:
                        tokens, seconds = await run_mix(one, args.requests, args.concurrency)
                    finally:
                        stop.set()
                        if training is not None:
                            await training  # the step under way ends before the next round: idle means idle
                    totals[side][0] += tokens
                    totals[side][1] += seconds
        finally:
            await verb(session, learner_url, "remove_experiment", RemoveExperimentRequest(name=trainee))
    idle, busy = (totals[s][0] / totals[s][1] for s in ("idle", "busy"))
    return {"rounds": rounds, "requests": args.requests, "n": args.n, "max_tokens": args.max_tokens,
            "concurrency": args.concurrency, "idle_tok_s": round(idle, 2), "busy_tok_s": round(busy, 2),
            "ratio": round(busy / idle, 3), "train_steps_during_busy": steps}


async def overlap_figure(client: AsyncClient, learner_port: int, mode) -> dict:
    """The figure in scripts/bench: experiment bench1's request mix (the front-end figure's), one group of
    it as the learner's training batch, `mode.fe_rounds` rounds of each side."""
    args = front_end_args(mode)
    group = await client.complete("bench1", messages=prompts(1)[0], n=args.n, max_tokens=args.max_tokens)
    return await overlap(client, f"http://127.0.0.1:{learner_port}", "bench1", group, args, mode.fe_rounds)
