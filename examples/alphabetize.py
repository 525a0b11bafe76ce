"""Teach the model to alphabetize 3-6 words, answering one word per line and nothing else.

    GRPO_SERVER_API_KEY=... python examples/alphabetize.py --steps 30

Reward with partial credit: the right words (0.4), in the right order (0.4), and the exact format, one
word per line with nothing else (0.2). An exact answer scores 1.0.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.task_runner import parse_args, run_task  # noqa: E402
from examples.words import WORDS  # noqa: E402


def make_prompt(rng: random.Random) -> tuple[list[dict], list[str]]:
    words = rng.sample(WORDS, rng.randint(3, 6))
    listing = "\n".join(words)
    content = (f"Sort these words in alphabetical order. Answer with the sorted words, one per line, "
               f"and nothing else.\n\n{listing}")
    return [{"role": "user", "content": content}], words


def score(text: str, words: list[str]) -> float:
    expected = sorted(words)
    lines = [line.strip() for line in text.replace("<|im_end|>", "").strip().splitlines() if line.strip()]
    answer = [line.lower().strip(".-*0123456789) ") for line in lines]
    present = len(set(answer) & set(expected)) / len(expected)
    ordered = [w for w in answer if w in expected]
    in_order = sum(1 for a, b in zip(ordered, ordered[1:]) if a < b) / max(len(expected) - 1, 1)
    exact_format = lines == expected
    return round(0.4 * present + 0.4 * min(in_order, present) + 0.2 * exact_format, 4)


if __name__ == "__main__":
    args = parse_args(__doc__, default_config=str(Path(__file__).parent.parent / "configs" / "alphabetize.yaml"))
    asyncio.run(run_task(args, make_prompt, score))
