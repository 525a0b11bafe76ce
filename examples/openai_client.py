"""GRPO through the OpenAI-compatible endpoint: sample with the official `openai` package, score, post the
rewards with grpo_server's own client.

    python examples/openai_client.py --experiment sky --rounds 5

The experiment is the OpenAI `model`. Each answer carries `group_id` (an extra field, in `model_extra`):
the rewards, one per choice in order, go to `/v1/experiments/{model}/feedback` with that id.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.task_runner import default_api_key  # noqa: E402
from grpo_server.client import Client, GrpoServerError  # noqa: E402

# SmolLM2-135M says "blue" in about 6% of its answers to this (16 samples, 8 tokens): groups of 8 often
# hold one, and the partial credit for staying on topic gives most groups some spread to learn from.
MESSAGES = [{"role": "user", "content": "What color is the sky?"}]


def reward(text: str) -> float:
    text = text.lower()
    return 1.0 if "blue" in text else 0.2 if "sky" in text else 0.0


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("GRPO_SERVER_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--api-key", default=default_api_key(),
                        help="admin key (env GRPO_SERVER_API_KEY, else runs/demo/admin_key)")
    parser.add_argument("--experiment", default="sky-colour", help="experiment name (the OpenAI model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=8, help="completions per round (the group size)")
    args = parser.parse_args(argv)
    if not args.api_key:
        parser.error("give --api-key or set GRPO_SERVER_API_KEY")

    llm = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=10)  # 429/503 retried
    means = []
    with Client(args.url, args.api_key) as grpo:
        try:
            grpo.create_experiment({"name": args.experiment, "algorithm": {"learning_rate": 5e-4, "batch_groups": 2},
                                    "sampling": {"n": args.n, "max_tokens": 12}})
        except GrpoServerError as exc:
            if exc.status != 409:
                raise  # 409: it exists already (a re-run continues it)
        for round_ in range(args.rounds):
            resp = llm.chat.completions.create(model=args.experiment, messages=MESSAGES, n=args.n,
                                               max_tokens=12, temperature=1.0)
            rewards = [reward(choice.message.content) for choice in resp.choices]
            grpo.feedback(args.experiment, resp.model_extra["group_id"], rewards)
            means.append(statistics.fmean(rewards))
            print(f"round {round_}: policy version {resp.model_extra['policy_version']}, "
                  f"reward mean {means[-1]:.3f}")
    llm.close()
    return means


if __name__ == "__main__":
    main()
