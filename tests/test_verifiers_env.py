"""examples/verifiers_env.py: verifiers' own rollouts (env.rollout, an AsyncOpenAI on the server's /v1) as episodes
of the real server on the tiny model, scored by the environment's rubric and rated as one group; verifiers reads
the server's vLLM-style token fields into its trajectory and tokenizes through the server's /tokenize."""

from __future__ import annotations

import openai
import verifiers as vf  # in the dev extra (pyproject.toml), so CI runs this: a missing one is an error, not a skip

from examples import verifiers_env


def test_rubric_rewards():
    parser = vf.Parser()
    info = {"other": "zebra"}

    def said(text: str) -> list[dict]:
        return [{"role": "assistant", "content": text}]
    assert verifiers_env.right_word(said("Apple."), "apple", info, parser) == 1.0
    assert verifiers_env.right_word(said("apple comes before zebra"), "apple", info, parser) == 0.3
    assert verifiers_env.right_word(said("zebra, then apple"), "apple", info, parser) == 0.0
    assert verifiers_env.right_word(said("I do not know"), "apple", info, parser) == 0.0
    assert verifiers_env.one_word(said("apple"), parser) == 1.0
    assert 0 < verifiers_env.one_word(said("it is apple"), parser) < 1.0
    assert verifiers_env.one_word(said(""), parser) == 0.0
    rows = verifiers_env.word_pairs()
    assert len(rows) == verifiers_env.DATASET_SIZE and rows == verifiers_env.word_pairs()  # the same every run
    assert all(r["answer"] < r["info"]["other"] and r["answer"] in r["question"] for r in rows)


async def test_one_group_of_rollouts_is_recorded_and_rated(server, client, tokenizer):
    name = "verifiers-env-test"
    await client.create_experiment({"name": name, "sampling": {"n": 4, "max_tokens": 4}})
    try:
        env = verifiers_env.load_environment(size=8)
        row = env.get_dataset()[0]
        sampling = verifiers_env.sampling_args({"sampling": {"max_tokens": 4}})
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0,
                                      timeout=300) as oai:
            rewards, states = await verifiers_env.rate_group(env, oai, client, name, row, 4, sampling)
            prompt_ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                       tokenize=True)["input_ids"]
            from verifiers.utils.token_utils import tokenize_vllm  # verifiers' client of vLLM's /tokenize
            assert await tokenize_vllm(oai, row["prompt"], None, name) == prompt_ids
        assert len(rewards) == 4 and all(0.0 <= r <= 1.0 for r in rewards)
        for state, reward in zip(states, rewards):
            assert state["reward"] == reward and len(state["trajectory"]) == 1
            tokens = state["trajectory"][0]["tokens"]  # verifiers' parse of return_token_ids + logprobs
            assert tokens["prompt_ids"] == prompt_ids
            assert 1 <= len(tokens["completion_ids"]) <= 4
            assert len(tokens["completion_logprobs"]) == len(tokens["completion_ids"])
            assert all(lp <= 0 for lp in tokens["completion_logprobs"])
        counters = (await client.status(name)).counters
        assert (counters.episodes_started, counters.episode_turns, counters.episodes_rated) == (4, 4, 4)
    finally:
        await client.delete_experiment(name)
