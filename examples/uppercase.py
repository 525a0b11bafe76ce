"""A second task to run beside alphabetize on the same server: write a word in capital letters.

    GRPO_SERVER_API_KEY=... python examples/uppercase.py --steps 30

Reward with partial credit: the word appears (0.2), the share of its letters written in capitals (0.4),
the answer is the word alone (0.2), and exactly the word in capitals (0.2).
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


def make_prompt(rng: random.Random) -> tuple[list[dict], str]:
    word = rng.choice(WORDS)
    content = f"Write the word '{word}' in capital letters. Answer with that one word only."
    return [{"role": "user", "content": content}], word


def score(text: str, word: str) -> float:
    """Partial credit, so that a small model finds some reward from the start."""
    match = re.search(re.escape(word), text, flags=re.IGNORECASE)
    if match is None:
        return 0.0
    written = match.group(0)
    capitals = sum(c.isupper() for c in written) / len(written)
    alone = text.strip().strip(".!'\"").lower() == word
    exact = text.strip().strip(".!'\"") == word.upper()
    return round(0.2 + 0.4 * capitals + 0.2 * alone + 0.2 * exact, 4)


if __name__ == "__main__":
    args = parse_args(__doc__, default_config=str(Path(__file__).parent.parent / "configs" / "uppercase.yaml"))
    asyncio.run(run_task(args, make_prompt, score))
