"""Teach the model to alphabetize 3-6 words, answering one word per line and nothing else.

    GRPO_SERVER_API_KEY=... python examples/alphabetize.py --steps 30

Reward with partial credit: the given words present anywhere (0.3), in sorted order by first appearance
(0.3), lines that are exactly one of the words (0.2), and the exact answer, nothing else (0.2).
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.task_runner import parse_args, run_task  # noqa: E402
from examples.words import WORDS  # noqa: E402


def make_prompt(rng: random.Random) -> tuple[list[dict], list[str]]:
    words = rng.sample(WORDS, rng.randint(3, 6))
    # The plainest wording scored best on SmolLM2-135M before training (mean reward 0.23 at T=0.8);
    # a worked example in the prompt confused it (0.07).
    content = "Put these words in alphabetical order, one per line:\n" + "\n".join(words)
    return [{"role": "user", "content": content}], words


def score(text: str, words: list[str]) -> float:
    """Partial credit, so that a small model finds some reward from the start."""
    expected = sorted(words)
    found = [w for w in re.findall(r"[a-z]+", text.lower()) if w in expected]
    first_seen = list(dict.fromkeys(found))  # expected words in order of first appearance
    present = len(first_seen) / len(expected)
    pairs = list(zip(first_seen, first_seen[1:]))
    in_order = sum(a < b for a, b in pairs) / (len(expected) - 1)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    clean_lines = sum(line.lower() in expected for line in lines) / max(len(lines), len(expected))
    exact = lines == expected
    return round(0.3 * present + 0.3 * in_order + 0.2 * clean_lines + 0.2 * exact, 4)


if __name__ == "__main__":
    args = parse_args(__doc__, default_config=str(Path(__file__).parent.parent / "configs" / "alphabetize.yaml"))
    asyncio.run(run_task(args, make_prompt, score))
