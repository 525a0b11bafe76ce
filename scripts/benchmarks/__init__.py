"""The performance benchmark of scripts/bench: one module per figure, run by `python -m scripts.benchmarks`.

Run every module from the repository root (`.venv/bin/python -m scripts.benchmarks.<module>`): they import
`grpo_server`, `sampler`, `learner`, `tests` and `examples` from there. Modules:

    __main__.py         the driver: modes, command-line flags, the chosen figures in order, JSON + table
    server.py           the one real server the server figures share (started, figures run, stopped)
    host.py             load average, other busy processes, and `figure`, which runs and records one figure
    front_end.py        front-end overhead: completions through the HTTP API vs vLLM in-process
    overlap.py          completion tok/s while the learner trains vs while it is idle
    experiments.py      1, 2, 4 (8) experiments sampling at once
    memory.py           peak RSS of the front end, sampler and learner trees
    push.py             weight push: train -> save -> load -> first completion -> verification
    episodes.py         agent episodes: OpenAI endpoint vs native API, prefix-cache hits of later turns
    learner_vs_peft.py  the learner's train step vs a plain peft + AdamW loop
    adapter.py          vLLM sampling with an adapter vs without
    sampler_start.py    a vLLM sampler's start, memory and tok/s with its worker in the engine core vs its own process
    end_to_end.py       time to a mean reward on alphabetize, this server vs TRL
    race.py             the race both end-to-end sides share, and the median over several runs
    trl_side.py         TRL's GRPOTrainer side of the end-to-end race
    load.py             a bounded load test: C concurrent clients for D seconds (--mix: the mixed round)
    load_mixed.py       the mixed round: plain, streaming, episode and tool-call clients; 5xx, RSS, event-loop lag
    load_kinds.py       the mixed round's client kinds
    fairness.py         a quiet experiment's latency alone vs beside a noisy experiment's flood (--only fairness)
    tinker_steps.py     time per GRPO step on alphabetize through the Tinker API vs the native route
    table.py            the summary table written into BENCHMARKS.md
    gpu_check.py        scripts/gpu-check's driver: each phase in its own process and time limit, one JSON
    gpu_phases.py       scripts/gpu-check's phases: model, learner, sampler, server, the race's two sides
    gpu_carry.py        what scripts/gpu-check carries to the GPU machine: wheels, the model in two halves
"""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
