"""Tinker's `asample`: n samples of one prompt under a sampler's weights (a saved version of a model, or the
base model), with the sampled tokens' logprobs, and the prompt's own logprobs when asked (what
`SamplingClient.compute_logprobs` reads).

Sampling goes through the experiment's own verb (`Experiment.sample_for_client`): the version is loaded on the
samplers if they let it go (only the serving version and those in use stay loaded) and kept loaded while the
request runs, the token budget holds its worst case, it is sampled in a sampling turn of its experiment, as
native completions are, and counted. Prompt logprobs are the sampler's `score` of the prompt's tokens after the
first: the same engine and weights that sample, so a sample's logprobs and compute_logprobs agree.
"""

from __future__ import annotations

from grpo_server.api.route_table import ADMIN
from grpo_server.api.tinker import schema as ts
from grpo_server.api.tinker.service import TinkerService
from grpo_server.api.tinker.state import Sampler
from grpo_server.api.tinker.data import SampledSequence, SampleResponse
from grpo_server.protocol.errors import BadRequest
from grpo_server.protocol.wire import GenerateRequest

DEFAULT_MAX_TOKENS = 16  # the SDK leaves max_tokens out when the client did not set it


def _check(request: ts.SampleRequest) -> None:
    params = request.sampling_params
    unsupported = [name for name, on in (
        ("top_k", params.top_k not in (-1, 0)), ("topk_prompt_logprobs", request.topk_prompt_logprobs > 0),
        ("topk_sample_logprobs", request.topk_sample_logprobs > 0),
        ("target_prompt_logprobs", request.target_prompt_logprobs is not None),
        ("prompt_alt_tokens_k", request.prompt_alt_tokens_k > 0),
        ("prompt_logprobs_last_n", request.prompt_logprobs_last_n is not None),
        ("record_stability_info", bool(request.record_stability_info))) if on]
    if unsupported:
        # top_k: the learner scores under temperature and top-p only; a top-k sample's logprobs would not match.
        raise BadRequest(f"not served here: {', '.join(unsupported)}", code="unsupported_parameter")
    if not 1 <= request.num_samples:
        raise BadRequest("num_samples must be at least 1", code="bad_request")


async def sample(service: TinkerService, sampler: Sampler, request: ts.SampleRequest) -> SampleResponse:
    _check(request)
    prompt = request.prompt.tokens()
    if not prompt:
        raise BadRequest("the prompt has no tokens", code="bad_request")
    params = request.sampling_params
    orchestrator = service.orchestrator
    max_tokens = params.max_tokens or DEFAULT_MAX_TOKENS
    orchestrator.prompts.check_fits(len(prompt), max_tokens)
    generate = GenerateRequest(
        prompt_token_ids=prompt, n=request.num_samples, temperature=params.temperature, top_p=params.top_p,
        max_tokens=max_tokens, stop=params.stop_strings() or None, seed=params.seed,
        stop_token_ids=params.stop_token_ids() or None, ignore_eos=params.stop == [])
    if sampler.model is not None and sampler.weights is not None:  # a saved version of a model: its experiment's
        experiment = orchestrator.get(sampler.model.experiment)
        version = (sampler.weights.version, sampler.weights.path)
    elif sampler.owner != ADMIN:  # the base model, for an experiment's key: inside its experiment's walls
        experiment, version = orchestrator.get(sampler.owner), None
    else:
        experiment = version = None
    if experiment is not None:
        result, scored = await experiment.sample_for_client(generate, version, score_prompt=request.prompt_logprobs)
    else:  # the admin's own samples of the base model: the server's token budget still holds their worst case
        result, scored = await orchestrator.sample_base_model(generate, request.prompt_logprobs)
    return SampleResponse(
        sequences=[SampledSequence(stop_reason="length" if c.finish_reason == "length" else "stop",
                                   tokens=c.token_ids, logprobs=c.logprobs) for c in result.completions],
        prompt_logprobs=None if not request.prompt_logprobs else [None, *(scored or [])])
