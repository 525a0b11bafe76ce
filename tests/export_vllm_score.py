"""Score token sequences with vLLM's offline `LLM` on a plain model folder, in a process of its own (run by
tests/test_export.py: vLLM is heavy to keep in the pytest process). Its engine core and model worker run in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni"), as the sampler's worker does
(sampler/vllm_start.py): vLLM's CPU defaults spawn two more processes, each importing torch and vLLM again.
Usage: `python -m tests.export_vllm_score MODEL_DIR < pairs.json`, where the JSON is `[[prompt_ids,
completion_ids], ...]`; the last stdout line is `RESULT <json>`: each completion's token
logprobs, as prompt logprobs at T = 1, the way the sampler scores (sampler/vllm_engine.py
`_score_untempered`), on float32 weights as the CPU sampler runs them.
"""

from __future__ import annotations

import json
import os
import sys

from grpo_server.protocol.cpu_features import limit_kernels

# At import, as sampler/__main__.py does: before torch loads, the same kernel library (AVX2 or AVX-512) as the
# sampler whose logprobs these are compared with.
CPU = limit_kernels()


def main(model: str) -> None:
    pairs = json.load(sys.stdin)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams, TokensPrompt

    from tests.serving import TINY_KV_CACHE_GIB

    llm = LLM(model=model, dtype="float32", max_model_len=513, seed=0, max_num_seqs=4,
              enable_prefix_caching=False, disable_log_stats=True, distributed_executor_backend="uni",
              enforce_eager=True,  # as the sampler runs (no torch.compile): compiling took 17 s of this test's 31
              kv_cache_memory_bytes=int(TINY_KV_CACHE_GIB * 2**30))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p + c) for p, c in pairs], params, use_tqdm=False)
    scores = [[float(out.prompt_logprobs[len(p) + i][token].logprob) for i, token in enumerate(c)]
              for (p, c), out in zip(pairs, outs)]
    print("RESULT " + json.dumps(scores), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
