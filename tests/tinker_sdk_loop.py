"""The tinker SDK's documented loop, run by whichever `tinker` the interpreter imports: one script for every release
in the supported range (tests/test_tinker_sdk_range.py runs it once per release, each in its own overlay venv,
tests/tinker_sdk_env.py). It uses only calls present from the range's floor to 0.38.0, so every release runs the
same steps: create a LoRA model, forward_backward (cross_entropy) and optim_step, save and sample, save_state,
a step away and load_state back, a new model from the saved state, the release's async style, the
capabilities answer, the checkpoint list, and close.

    python tests/tinker_sdk_loop.py URL KEY BASE_MODEL    (KEY with its tml- prefix; HF_HUB_OFFLINE=1 for a path)

It prints one JSON line (`RESULT {...}`: the version it ran, the losses, the sampled tokens) and exits 0 only if
every check held; a failed check exits 1 naming it. Stdlib and the SDK only: it runs outside the project's venv too.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from typing import Any

os.environ.setdefault("TINKER_TELEMETRY", "0")  # no telemetry thread: the test server accepts and drops it anyway

import tinker  # noqa: E402
from tinker import types  # noqa: E402

RANK = 8
LEARNING_RATE = 1e-2
TEXTS = ("The quick brown fox jumps over the lazy dog.", "One, two, three, four, five, six.")


class LoopFailed(Exception):
    """A check of the loop did not hold: what was expected and what came back."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise LoopFailed(what)


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


def ready(created: Any) -> Any:
    """A client from a client-making call. From 0.38 those calls return a future of the client (still usable as the
    client, with a FutureWarning); before, the client itself, which has no `result`."""
    return created.result() if hasattr(created, "result") else created


def datum(tokens: list[int]) -> types.Datum:
    """Next-token prediction over `tokens`: input tokens[:-1], targets tokens[1:], every position weighted 1."""
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def loss_of(training: Any, data: list[types.Datum]) -> float:
    return float(training.forward(data, "cross_entropy").result().metrics["loss:sum"])


def step(training: Any, data: list[types.Datum]) -> float:
    """forward_backward then optim_step; the loss before the step."""
    out = training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE)).result()
    return float(out.metrics["loss:sum"])


async def async_calls(training: Any, sampler: Any, data: list[types.Datum], prompt: types.ModelInput) -> tuple:
    """The async style each release documents: `await client.x_async(...)` gives a future to await, up to 0.36;
    0.38 deprecates the `_async` methods and makes the futures of the plain calls awaitable instead."""
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    if version_tuple(tinker.__version__) >= (0, 38):
        forward = await training.forward(data, "cross_entropy")
        sample = await sampler.sample(prompt, num_samples=1, sampling_params=params)
    else:
        forward = await (await training.forward_async(data, "cross_entropy"))
        sample = await sampler.sample_async(prompt, num_samples=1, sampling_params=params)
    return float(forward.metrics["loss:sum"]), list(sample.sequences[0].tokens)


def rest_calls(service: Any, url: str, key: str) -> tuple[Any, Any]:
    """A RestClient and the server's capabilities, as each release has them: 0.36 constructs RestClient directly
    (deprecating ServiceClient.create_rest_client), and 0.38 moves get_server_capabilities from ServiceClient (where
    it answered at once) to RestClient (a future)."""
    version = version_tuple(tinker.__version__)
    rest = tinker.RestClient(base_url=url, api_key=key) if version >= (0, 36) else service.create_rest_client()
    capabilities = rest.get_server_capabilities().result() if version >= (0, 38) else service.get_server_capabilities()
    return rest, capabilities


def run(url: str, key: str, base_model: str) -> dict[str, Any]:
    report: dict[str, Any] = {"version": tinker.__version__, "module": tinker.__file__}
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = ready(service.create_lora_training_client(base_model=base_model, rank=RANK))
    info = training.get_info()
    check(info.lora_rank == RANK, f"get_info's lora_rank {info.lora_rank}, not {RANK}")
    tokenizer = training.get_tokenizer()
    data = [datum(tokenizer.encode(text)) for text in TEXTS]

    # One step lowers the loss: Adam's first step moves every weight against its gradient's sign.
    report["loss_before"] = step(training, data)
    report["loss_after"] = loss_of(training, data)
    check(report["loss_after"] < report["loss_before"],
          f"the loss did not fall after optim_step: {report['loss_before']} -> {report['loss_after']}")

    sampler = ready(training.save_weights_and_get_sampling_client())
    prompt = types.ModelInput.from_ints(tokenizer.encode("One, two,"))
    result = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=6, seed=7)).result()
    report["sampled"] = [list(seq.tokens) for seq in result.sequences]
    check(len(report["sampled"]) == 2 and all(report["sampled"]), f"sample returned {report['sampled']}")
    check(all(len(seq.logprobs or []) == len(seq.tokens) for seq in result.sequences), "sample's logprobs")

    # save_state, a step away from it, load_state back: the loss is the saved weights' again.
    saved = training.save_state("loop").result().path
    check(saved.startswith("tinker://") and saved.endswith("/weights/loop"), f"save_state's path {saved!r}")
    report["saved_path"] = saved
    step(training, data)
    report["loss_moved"] = loss_of(training, data)
    check(not math.isclose(report["loss_moved"], report["loss_after"], rel_tol=1e-4),
          f"a step after save_state left the loss at {report['loss_moved']}")
    training.load_state(saved).result()
    report["loss_loaded"] = loss_of(training, data)
    check(math.isclose(report["loss_loaded"], report["loss_after"], rel_tol=1e-4),
          f"load_state did not restore: {report['loss_loaded']} against {report['loss_after']} when saved")

    # The same state in a new model (what load_state gives way to: 0.36 deprecates it), with its optimizer.
    restored = ready(service.create_training_client_from_state_with_optimizer(saved))
    report["loss_restored"] = loss_of(restored, data)
    check(math.isclose(report["loss_restored"], report["loss_after"], rel_tol=1e-4),
          f"create_training_client_from_state_with_optimizer: {report['loss_restored']} against {report['loss_after']}")

    report["async_loss"], report["async_sampled"] = asyncio.run(async_calls(training, sampler, data, prompt))
    check(math.isclose(report["async_loss"], report["loss_loaded"], rel_tol=1e-4), "the async forward's loss")
    check(bool(report["async_sampled"]), "the async sample returned no tokens")

    rest, capabilities = rest_calls(service, url, key)
    report["capabilities"] = [model.model_name for model in capabilities.supported_models]
    check(report["capabilities"] == [info.model_data.model_name], f"capabilities: {report['capabilities']}")
    checkpoints = rest.list_checkpoints(training.model_id).result().checkpoints
    report["checkpoints"] = sorted(c.checkpoint_id for c in checkpoints)
    check("weights/loop" in report["checkpoints"], f"list_checkpoints: {report['checkpoints']}")
    if hasattr(service, "close"):  # from 0.27: it ends the session and its heartbeat (before, the process's end does)
        ready(service.close("success"))
    return report


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        report = run(*argv[1:])
    except LoopFailed as failed:
        print(f"FAILED with tinker {tinker.__version__}: {failed}", file=sys.stderr)
        return 1
    print("RESULT " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
