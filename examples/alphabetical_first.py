"""The verifiers 0.4.0 plugin of examples/verifiers_env.py: taskset id `alphabetical-first`.

verifiers 0.4.0 loads a taskset by id as a module (`alphabetical-first` -> `alphabetical_first`, found on
`sys.path`: examples/verifiers_env.py puts this folder there) that exports exactly one `vf.Taskset` subclass in
`__all__`; a `vf.Harness` subclass exported beside it is the taskset's default harness
(verifiers/v1/utils/loaders.py: `_import_plugin`, `_plugin_class`, `default_harness_id`). Needs the verifiers
client environment (`.venv-verifiers`, scripts/setup); the rewards themselves are plain functions of
examples/verifiers_env.py.

- `WordPairTask`: the task's rewards as verifiers' `@vf.reward` methods (weights 0.7 and 0.3); a trace's
  `reward` is their weighted sum.
- `AlphabeticalFirst`: the 300 fixed word pairs as tasks.
- `OneTurnChat`: the program that plays the seat, in process (verifiers/v1/harness.py allows it: every model
  call goes through the rollout's interception endpoint with its secret). verifiers' built-in `null` and
  `bash` harnesses run a PEP 723 script through `uv`, which installs its own packages at rollout time; this
  one asks once, with the OpenAI SDK, and keeps the server's vLLM token fields (`prompt_token_ids`,
  per-choice `token_ids`, `logprobs`) that verifiers' eval client relays back unchanged, in `trace.info`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples import verifiers_env as words  # noqa: E402

__all__ = ["AlphabeticalFirst", "OneTurnChat"]


class WordPairData(vf.TaskData):
    answer: str  # the word that comes first
    other: str


class WordPairConfig(vf.TasksetConfig):
    size: int = words.DATASET_SIZE
    seed: int = words.DATASET_SEED


class WordPairTask(vf.Task[WordPairData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=words.WEIGHTS["right_word"])
    async def right_word(self, task: WordPairData, trace: vf.Trace) -> float:
        return words.right_word(trace.last_reply, task.answer, task.other)

    @vf.reward(weight=words.WEIGHTS["one_word"])
    async def one_word(self, trace: vf.Trace) -> float:
        return words.one_word(trace.last_reply)


class AlphabeticalFirst(vf.Taskset[WordPairTask, WordPairConfig]):
    def load(self):
        for row in words.word_pairs(self.config.size, self.config.seed):
            data = WordPairData(prompt=row["question"], answer=row["answer"], other=row["other"])
            yield WordPairTask(data, self.config.task)


class OneTurnChat(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False  # no tools, nothing run on the host
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
            m.model_dump(exclude_none=True) for m in prompt]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        # The model and sampling (with the episode's id) are imposed by the interception from ctx. The
        # interception hands the server's status on (verifiers' eval client itself never retries), so the SDK
        # waits out back-pressure (429 while the learner steps) as an agent's would.
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=1000, timeout=600) as oai:
            completion = await oai.chat.completions.create(model=ctx.model, messages=messages)
        raw = completion.to_dict()
        choice = raw["choices"][0]
        trace.info["tokens"] = {
            "prompt_ids": raw.get("prompt_token_ids"),
            "completion_ids": choice.get("token_ids"),
            "completion_logprobs": [t["logprob"] for t in (choice.get("logprobs") or {}).get("content") or []],
        }
        return ProgramResult(exit_code=0, stdout=choice["message"].get("content") or "", stderr="")
