"""A second task to run beside alphabetize on the same server: write a word in capital letters.

    GRPO_SERVER_API_KEY=... python examples/uppercase.py --steps 30

Reward: 1.0 for exactly the word in capitals, 0.5 for the word in other casing, 0.2 if the capitalised
word appears somewhere in a longer answer, 0 otherwise.
"""

from __future__ import annotations

import asyncio
import random
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
    answer = text.replace("<|im_end|>", "").strip().strip(".'\"")
    if answer == word.upper():
        return 1.0
    if answer.lower() == word:
        return 0.5
    return 0.2 if word.upper() in answer else 0.0


if __name__ == "__main__":
    args = parse_args(__doc__, default_config=str(Path(__file__).parent.parent / "configs" / "uppercase.yaml"))
    asyncio.run(run_task(args, make_prompt, score))
