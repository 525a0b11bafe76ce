"""The Tinker API under `/api/v1`, as the `tinker` SDK 0.38 calls it (docs/tinker-wire.md is the wire; the releases
from 0.22.7 on are served too: data.py SDK_RELEASES_TESTED), and `ROUTES`, its table. The key rides in `X-API-Key`
(`tml-` + a key of this server: api/edge.py strips the prefix); a Tinker model is an experiment, scoped like one
(service.py).

A call that runs on a model answers at once with a request id (`UntypedAPIFuture`); the work runs in the
model's `seq_id` order (futures.py) and `retrieve_future` long-polls for it: 408 with a try-again body
while it runs, the result (protobuf for forward/forward_backward/sample, JSON otherwise), a failed call as
`{"error", "category"}` (`user` for the client's mistakes, `server` for ours), 410 once a result expired.
Checks that need no model (the body's shape, the key) answer at once with the server's usual 4xx.
"""

from __future__ import annotations

import functools
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any, Awaitable, Callable

from aiohttp import web
from pydantic import BaseModel

from grpo_server.api.app_state import TINKER
from grpo_server.api.route_table import ADMIN, RESOURCE, BodyCodec, Endpoint, Principal, QueryParameter
from grpo_server.api.tinker import schema as ts
from grpo_server.api.tinker.data import (LOSS_VALUES_PER_POSITION, MAX_DATUMS_PER_CALL, ForwardBackwardOutput,
                                         SampleResponse)
from grpo_server.api.tinker.futures import Pending
from grpo_server.api.tinker.protobuf import (PROTO_CONTENT_TYPE, OverLimit, decode_forward_backward_request,
                                             encode_forward_backward_output, encode_sample_response,
                                             forward_backward_model_id)
from grpo_server.api.tinker.sampling import sample
from grpo_server.api.tinker.service import failure
from grpo_server.api.tinker.state import TinkerModel, parse_path
from grpo_server.protocol.errors import ApiError, BadRequest, NotFound, Unprocessable

LONG_POLL_S = 30.0  # the SDK's read timeout is 45 s, and it polls again at once after a 408


def _json(payload: BaseModel, status: int = 200) -> web.Response:
    # The SDK validates its answers strictly: a null where it wants a value or nothing fails, so Nones are left out.
    return web.Response(text=payload.model_dump_json(exclude_none=True), status=status,
                        content_type="application/json")


def _submit(request: web.Request, owner: str, work: Callable[[], Awaitable[Any]],
            model: TinkerModel | None = None, seq_id: int | None = None,
            on_end: Callable[[], None] | None = None, **extra: Any) -> web.Response:
    """Start `work` (after every lower seq_id of `model`) and answer its future. The same seq_id again is a
    retry of the same call: the same future. `on_end` is called once the call has ended, or at once if `work`
    will not run (a retry, a refusal)."""
    end = on_end or (lambda: None)
    try:
        return _submitted(request, owner, work, model, seq_id, end, **extra)
    except BaseException:
        end()
        raise


def _submitted(request: web.Request, owner: str, work: Callable[[], Awaitable[Any]], model: TinkerModel | None,
               seq_id: int | None, end: Callable[[], None], **extra: Any) -> web.Response:
    futures = request.app[TINKER].futures

    async def then_end() -> Any:
        try:
            return await work()
        finally:
            end()
    if model is None:
        return _json(ts.UntypedAPIFuture(request_id=futures.submit(owner, then_end), **extra))
    known = model.lane.known(seq_id)
    if known is not None:
        end()
        return _json(ts.UntypedAPIFuture(request_id=known, model_id=model.model_id, **extra))
    try:
        model.lane.check(seq_id)
    except ApiError as exc:
        error = exc
        end()

        async def refused() -> Any:
            raise error
        return _json(ts.UntypedAPIFuture(request_id=futures.submit(owner, refused), **extra))

    async def in_order() -> Any:
        try:
            async with model.lane.turn(seq_id):
                return await work()
        finally:
            end()
    # Registered with its experiment while it waits for its turn too: a delete cancels it (service.on_experiment).
    request_id = futures.submit(owner, request.app[TINKER].on_experiment(model.experiment, in_order))
    model.lane.remember(seq_id, request_id)
    return _json(ts.UntypedAPIFuture(request_id=request_id, model_id=model.model_id, **extra))


def _model_call(request: web.Request, owner: str, seq_id: int | None,
                run: Callable[[TinkerModel], Awaitable[Any]], on_end: Callable[[], None] | None = None,
                ) -> web.Response:
    """A call on the row's model (the table resolved it for the caller: api/route_table.py `resource`), in its
    seq_id order: a call made while the learner restarts waits for it, and the first call after a restart rolled
    the model back fails, naming what was lost (service.rollback)."""
    service = request.app[TINKER]
    model = request[RESOURCE]

    async def unless_rolled_back() -> Any:  # in seq_id order: the first call to run after a restart is told
        # A learner that is restarting is waited for (the SDK does not retry a failed call): then this call knows
        # whether the restart rolled the model back.
        await service.orchestrator.learner_settled(service.orchestrator.config.worker_timeout_s)
        lost = service.rollback(model)
        if lost is not None:
            raise lost
        return await run(model)
    return _submit(request, owner, unless_rolled_back, model, seq_id, on_end=on_end)


# The model a row acts on, for the table to resolve (`resource`): an unknown one, another key's, or one whose
# experiment was deleted is a 404 `model_not_found` before the handler runs.

def _model_named(field: str) -> Callable[[web.Request, Principal, Any], TinkerModel]:
    def resolve(request: web.Request, who: Principal, body: Any) -> TinkerModel:
        return request.app[TINKER].model(who.owner, getattr(body, field))
    return resolve


def _model_in_path(request: web.Request, who: Principal, body: Any) -> TinkerModel:
    return request.app[TINKER].model(who.owner, request.match_info["model_id"])


def _model_loaded(request: web.Request, who: Principal, body: Any) -> TinkerModel:
    """load_weights: the live model it loads into, or (create-via-load) the model whose checkpoint it reads."""
    model_id = body.model_id if body.model_id is not None else parse_path(body.path, "weights")[0]
    return request.app[TINKER].model(who.owner, model_id)


def _model_of_path(field: str, kind: str | None) -> Callable[[web.Request, Principal, Any], TinkerModel | None]:
    """The model of a tinker:// path in `field` (None: the field is unset); `kind` None: weights or sampler."""
    def resolve(request: web.Request, who: Principal, body: Any) -> TinkerModel | None:
        path = getattr(body, field)
        if path is None:
            return None
        parts = path.removeprefix("tinker://").split("/")
        model_id, _ = parse_path(path, kind or (parts[1] if len(parts) == 3 else "weights"))
        return request.app[TINKER].model(who.owner, model_id)
    return resolve


def _peek_forward_backward(body: bytes) -> SimpleNamespace:
    return SimpleNamespace(model_id=forward_backward_model_id(body))


def _forward_backward_decoder(request: web.Request) -> Callable[[bytes], Any]:
    """Decoding stops once the body holds more than a call may (tinker_max_tokens_per_call positions, and
    LOSS_VALUES_PER_POSITION values a position): a 422 `over_limit` at once, before it is built whole. A partial of
    the module-level decoder: it runs in the body pool's process (plain Python, it would hold the GIL)."""
    cap = request.app[TINKER].orchestrator.config.tinker_max_tokens_per_call
    return functools.partial(decode_forward_backward_request, max_positions=cap,
                             max_values=LOSS_VALUES_PER_POSITION * cap)


FORWARD_BACKWARD = BodyCodec(PROTO_CONTENT_TYPE, "a protobuf tinker_public.ForwardBackwardRequest",
                             _peek_forward_backward, _forward_backward_decoder, in_process=True,
                             over_limit=(OverLimit,))


# --- set-up, sessions, service ------------------------------------------------------------------------------------

async def client_config(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    return _json(ts.ClientConfigResponse(fwdbwd_max_chunk_len=MAX_DATUMS_PER_CALL,  # what a call may hold
                                         proto_write_fwdbwd=True, fwd_via_fwdbwd=True))


async def dynamic_config(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    return _json(ts.ClientDynamicConfigResponse())


async def create_session(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    return _json(ts.CreateSessionResponse(session_id=await request.app[TINKER].create_session(owner)))


async def session_heartbeat(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    request.app[TINKER].session(owner, body.session_id)
    return _json(ts.SessionHeartbeatResponse())


async def finish_session(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    request.app[TINKER].session(owner, request.match_info["session_id"])
    return web.json_response({})


async def telemetry(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    # accepted, not kept: the server's own metrics tell more
    return _json(ts.TelemetryResponse())


async def healthz(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    return _json(ts.HealthResponse())


async def capabilities(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    orchestrator = request.app[TINKER].orchestrator
    tested = list(ts.SDK_RELEASES_TESTED)
    return _json(ts.GetServerCapabilitiesResponse(supported_models=[ts.SupportedModel(
        model_name=request.app[TINKER].base_model, max_context_length=orchestrator.config.max_model_len,
        trainable=True, sampleable=True)], supported_sdk_versions=ts.SdkVersions(min=tested[0], max=tested[-1],
                                                                                  tested=tested)))


# --- models and training ------------------------------------------------------------------------------------------

async def create_model(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    service = request.app[TINKER]
    lora = body.lora_config or ts.LoraConfig(rank=32)

    async def run() -> ts.CreateModelResponse:
        model = await service.create_model(owner, body.session_id, body.model_seq_id, body.base_model, lora)
        return ts.CreateModelResponse(model_id=model.model_id)
    return _submit(request, owner, run)


async def get_info(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    service = request.app[TINKER]
    return _json(service.info(request[RESOURCE]))


async def forward_backward(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    """The body is protobuf (the row's codec): the table checked its model before decoding the rest, and the
    decoder its bounds. It then waits in its model's lane at full size, so a key's decoded calls are admitted by
    their token positions (429 `too_many_tokens_queued` beyond)."""
    service = request.app[TINKER]
    positions = sum(d.model_input.length for d in body.forward_backward_input.data)
    release = service.admit_positions(who.owner, positions)
    return _model_call(request, who.owner, body.seq_id, lambda m: service.forward_backward(m, body), release)


async def optim_step(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    service = request.app[TINKER]
    return _model_call(request, owner, body.seq_id, lambda m: service.optim_step(m, body))


async def save_weights(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    service = request.app[TINKER]

    async def run(model: TinkerModel) -> ts.SaveWeightsResponse:
        return ts.SaveWeightsResponse(path=await service.save_weights(model, body.path, body.ttl_seconds))
    return _model_call(request, owner, body.seq_id, run)


async def save_weights_for_sampler(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    service = request.app[TINKER]

    async def run(model: TinkerModel) -> ts.SaveWeightsForSamplerResponse:
        weights = await service.save_for_sampler(model, body.path, body.ttl_seconds)
        if body.path is not None:
            return ts.SaveWeightsForSamplerResponse(path=f"tinker://{model.model_id}/sampler_weights/{body.path}")
        sampler = service.new_sampler(owner, model, weights, None)
        return ts.SaveWeightsForSamplerResponse(sampling_session_id=sampler.sampler_id)
    return _model_call(request, owner, body.seq_id, run)


async def save_weights_external(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    service = request.app[TINKER]

    async def run(model: TinkerModel) -> ts.SaveWeightsExternalResponse:
        path, size = await service.save_external(model, body)
        return ts.SaveWeightsExternalResponse(path=path, size_bytes=size)
    return _model_call(request, who.owner, body.seq_id, run)


async def load_weights(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    service = request.app[TINKER]

    async def run() -> ts.LoadWeightsResponse:
        model = await service.load_weights(owner, body)
        return ts.LoadWeightsResponse(path=body.path, model_id=model.model_id)
    if body.model_id is not None:  # the legacy load into a live model: in its seq_id order
        return _model_call(request, owner, body.seq_id, lambda _: run())
    return _submit(request, owner, run)


# --- sampling -----------------------------------------------------------------------------------------------------

async def create_sampling_session(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    service = request.app[TINKER]
    service.session(owner, body.session_id)
    if body.model_path is not None:
        sampler = service.sampler_for_path(owner, body.model_path, request[RESOURCE])
    else:
        service.check_base_model(body.base_model)
        sampler = service.new_sampler(owner, None, None, None)
    return _json(ts.CreateSamplingSessionResponse(sampling_session_id=sampler.sampler_id))


async def get_sampler(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    service = request.app[TINKER]
    sampler = service.sampler(owner, request.match_info["sampler_id"])
    return _json(ts.GetSamplerResponse(sampler_id=sampler.sampler_id, base_model=service.base_model,
                                       model_path=sampler.model_path))


async def asample(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    service = request.app[TINKER]
    limits = service.orchestrator.config
    if body.num_samples > limits.max_n:  # before anything is built for them
        raise Unprocessable(f"num_samples {body.num_samples} is over the server's max_n {limits.max_n}",
                            code="over_limit")
    if (body.sampling_params.max_tokens or 0) > limits.max_tokens:
        raise Unprocessable(f"max_tokens {body.sampling_params.max_tokens} is over the server's max_tokens "
                            f"{limits.max_tokens}", code="over_limit")
    if body.sampling_session_id is not None:
        sampler = service.sampler(owner, body.sampling_session_id)
    elif body.model_path is not None:
        sampler = service.sampler_for_path(owner, body.model_path)
    else:
        service.check_base_model(body.base_model or service.base_model)
        sampler = service.new_sampler(owner, None, None, None)
    ids = [f"{sampler.sampler_id}:{body.seq_id or 0}:{i}" for i in range(body.num_samples)]
    if body.seq_id is not None and body.seq_id in sampler.seen:  # the SDK's resubmission after a 429
        return _json(ts.UntypedAPIFuture(request_id=sampler.seen[body.seq_id], sample_sequence_ids=ids))
    release = service.admit_samples(owner, body.num_samples)  # 429 before anything is queued
    experiment = sampler.model.experiment if sampler.model is not None else None if owner == ADMIN else owner
    response = _submit(request, owner, service.on_experiment(experiment, lambda: sample(service, sampler, body)),
                       on_end=release, sample_sequence_ids=ids)
    if body.seq_id is not None:
        sampler.remember(body.seq_id, ts.UntypedAPIFuture.model_validate_json(response.text).request_id)
    return response


# --- futures ------------------------------------------------------------------------------------------------------

async def retrieve_future(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    futures = request.app[TINKER].futures
    try:
        outcome = await futures.retrieve(body.request_id, owner, LONG_POLL_S)
    except Pending:
        return _json(ts.TryAgainResponse(request_id=body.request_id), status=408)
    except NotFound as exc:  # 410: the SDK's "expired" (a sample is resubmitted; a training call fails)
        raise ApiError(exc.message, code=exc.code, status=410) from exc
    if outcome.error is not None:
        return _json(failure(outcome.error))
    if isinstance(outcome.value, ForwardBackwardOutput):
        return web.Response(body=encode_forward_backward_output(outcome.value), content_type=PROTO_CONTENT_TYPE)
    if isinstance(outcome.value, SampleResponse):
        return web.Response(body=encode_sample_response(outcome.value), content_type=PROTO_CONTENT_TYPE)
    return _json(outcome.value)


async def cancel_future(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    request.app[TINKER].futures.cancel(body.request_id, owner)
    return web.json_response({})


# --- checkpoints and runs -----------------------------------------------------------------------------------------

async def weights_info(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    service = request.app[TINKER]
    model = request[RESOURCE]
    return _json(ts.WeightsInfoResponse(base_model=service.base_model, is_lora=True, lora_rank=model.lora.rank,
                                        train_mlp=model.lora.train_mlp, train_attn=model.lora.train_attn,
                                        train_unembed=False))


async def training_run(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    owner = who.owner
    service = request.app[TINKER]
    model = request[RESOURCE]
    return _json(ts.TrainingRun(training_run_id=model.model_id, base_model=service.base_model, model_owner=owner,
                                is_lora=True, lora_rank=model.lora.rank,
                                last_request_time=datetime.fromtimestamp(model.last_request_at, timezone.utc)))


async def list_checkpoints(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    service = request.app[TINKER]
    model = request[RESOURCE]
    return _json(ts.CheckpointsListResponse(checkpoints=await service.checkpoints(model)))


async def user_checkpoints(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    """Every checkpoint of the caller's models (the admin's: every model's), newest first, a page at a time."""
    service = request.app[TINKER]
    offset, limit = _count(request, "offset", 0, 0, None), _count(request, "limit", LISTED_DEFAULT, 1, MAX_LISTED)
    models = [model for model in service.models.values() if (who.owner == ADMIN or model.owner == who.owner)
              and model.experiment in service.orchestrator.experiments]
    listed = await service.all_checkpoints(models)
    return _json(ts.CheckpointsListResponse(checkpoints=listed[offset:offset + limit],
                                            cursor=ts.Cursor(offset=offset, limit=limit, total_count=len(listed))))


def _count(request: web.Request, name: str, default: int, least: int, most: int | None) -> int:
    """The integer query parameter `name` (`default` if absent), from `least` to `most`; a 400 otherwise."""
    raw = request.query.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least or (most is not None and value > most):
        bound = f"from {least} to {most}" if most is not None else f"of {least} or more"
        raise BadRequest(f"{name} must be an integer {bound}, got {raw!r}", code=f"bad_{name}")
    return value


async def external_weights_urls(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    """Refused, whatever the checkpoint (the table checked the caller's model): the hosted service signs download
    URLs of an object store, and here external weights are folders on the server's disk, which no URL names. A
    400, which the SDK raises at once (a 5xx it would retry for minutes)."""
    model = request[RESOURCE]
    raise BadRequest("external_weights_urls: not served here (no signed download URLs): external weights are "
                     f"folders on the server's disk, in its run directory's tinker/external_weights/{model.model_id}/",
                     code="not_served")


async def delete_checkpoint(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    service = request.app[TINKER]
    model = request[RESOURCE]
    await service.delete_checkpoint(model, f"{request.match_info['kind']}/{request.match_info['checkpoint']}")
    return web.Response(status=204)


API = "/api/v1"
RUN = API + "/training_runs/{model_id}"
LISTED_DEFAULT, MAX_LISTED = 100, 1000  # checkpoints per page of GET /api/v1/checkpoints (the SDK asks for 100)
LISTING_QUERY = (
    QueryParameter("limit", f"At most this many checkpoints, the newest first (default {LISTED_DEFAULT})",
                   {"type": "integer", "minimum": 1, "maximum": MAX_LISTED}),
    QueryParameter("offset", "Skip this many (default 0)", {"type": "integer", "minimum": 0}),
)


def _row(method: str, path: str, handler, request_model, response_model, summary: str, status: int = 200,
         errors: tuple[int, ...] = (), auth: str = "key", content_type: str = "application/json",
         model: Callable[[web.Request, Principal, Any], Any] | None = None, codec: BodyCodec | None = None,
         query: tuple[QueryParameter, ...] = ()) -> Endpoint:
    return Endpoint(method, API + path, handler, request_model, response_model, status, f"Tinker: {summary}", auth,
                    errors, content_type, query=query, resource=model, codec=codec)


ROUTES: tuple[Endpoint, ...] = (
    _row("POST", "/client/config", client_config, ts.ClientConfigRequest, ts.ClientConfigResponse,
         "the SDK's feature flags"),
    _row("POST", "/client/dynamic_config", dynamic_config, None, ts.ClientDynamicConfigResponse,
         "the SDK's refreshed flags"),
    _row("POST", "/create_session", create_session, ts.CreateSessionRequest, ts.CreateSessionResponse,
         "a session for this key's models and samplers"),
    _row("POST", "/session_heartbeat", session_heartbeat, ts.SessionHeartbeatRequest, ts.SessionHeartbeatResponse,
         "a session is alive", errors=(404,)),
    _row("POST", "/sessions/{session_id}/finish", finish_session, ts.SessionFinishRequest, None,
         "a session ended", errors=(404,)),
    _row("POST", "/telemetry", telemetry, ts.TelemetrySendRequest, ts.TelemetryResponse, "accepted, not kept"),
    _row("GET", "/healthz", healthz, None, ts.HealthResponse, "alive", auth="public"),
    _row("GET", "/get_server_capabilities", capabilities, None, ts.GetServerCapabilitiesResponse,
         "the base model this server trains and samples"),
    _row("POST", "/create_model", create_model, ts.CreateModelRequest, ts.UntypedAPIFuture,
         "a LoRA training model (an experiment); future of CreateModelResponse"),
    _row("POST", "/get_info", get_info, ts.GetInfoRequest, ts.GetInfoResponse, "a model's base model and LoRA rank",
         model=_model_named("model_id")),
    _row("POST", "/forward_backward", forward_backward, None, ts.UntypedAPIFuture,
         "forward (forward_only) or forward and backward; the body is a protobuf ForwardBackwardRequest; future "
         "of a protobuf ForwardBackwardOutput", codec=FORWARD_BACKWARD, model=_model_named("model_id")),
    _row("POST", "/optim_step", optim_step, ts.OptimStepRequest, ts.UntypedAPIFuture,
         "one AdamW step on the gradients summed since the last; future of OptimStepResponse",
         model=_model_named("model_id")),
    _row("POST", "/save_weights", save_weights, ts.SaveWeightsRequest, ts.UntypedAPIFuture,
         "a training checkpoint (adapter and optimizer state); future of SaveWeightsResponse",
         model=_model_named("model_id")),
    _row("POST", "/save_weights_for_sampler", save_weights_for_sampler, ts.SaveWeightsForSamplerRequest,
         ts.UntypedAPIFuture, "a version pushed to the samplers; future of SaveWeightsForSamplerResponse",
         model=_model_named("model_id")),
    _row("POST", "/save_weights_external", save_weights_external, ts.SaveWeightsExternalRequest, ts.UntypedAPIFuture,
         "the adapter as a peft folder on the server's disk (a version pushed and checked first); future of "
         "SaveWeightsExternalResponse", model=_model_named("model_id")),
    _row("POST", "/load_weights", load_weights, ts.LoadWeightsRequest, ts.UntypedAPIFuture,
         "a checkpoint into a new or live model; future of LoadWeightsResponse", model=_model_loaded),
    _row("POST", "/create_sampling_session", create_sampling_session, ts.CreateSamplingSessionRequest,
         ts.CreateSamplingSessionResponse, "a sampler on saved weights or the base model", errors=(404,),
         model=_model_of_path("model_path", "sampler_weights")),
    _row("GET", "/samplers/{sampler_id}", get_sampler, None, ts.GetSamplerResponse, "a sampler", errors=(404,)),
    _row("POST", "/asample", asample, ts.SampleRequest, ts.UntypedAPIFuture,
         "samples of a prompt; future of a protobuf SampleResponse", errors=(404,)),
    _row("POST", "/retrieve_future", retrieve_future, ts.FutureRetrieveRequest, None,
         "a call's result (long poll; 408 while it runs, 410 once expired)", errors=(408, 410)),
    _row("POST", "/cancel_future", cancel_future, ts.CancelFutureRequest, None, "cancel a call"),
    _row("POST", "/weights_info", weights_info, ts.WeightsInfoRequest, ts.WeightsInfoResponse,
         "what a checkpoint holds", model=_model_of_path("tinker_path", None)),
    _row("GET", "/training_runs/{model_id}", training_run, None, ts.TrainingRun, "a model as a training run",
         model=_model_in_path),
    _row("GET", "/training_runs/{model_id}/checkpoints", list_checkpoints, None, ts.CheckpointsListResponse,
         "a model's checkpoints", model=_model_in_path),
    _row("DELETE", "/training_runs/{model_id}/checkpoints/{kind}/{checkpoint}", delete_checkpoint, None, None,
         "delete a checkpoint", status=204, errors=(404,), model=_model_in_path),
    _row("GET", "/training_runs/{model_id}/checkpoints/{kind}/{checkpoint}/external_weights_urls",
         external_weights_urls, None, None, "refused: external weights stay on the server's disk (no signed URLs)",
         status=400, errors=(400,), model=_model_in_path),
    _row("GET", "/checkpoints", user_checkpoints, None, ts.CheckpointsListResponse,
         "every checkpoint of the caller's models, newest first", errors=(400,), query=LISTING_QUERY),
)
