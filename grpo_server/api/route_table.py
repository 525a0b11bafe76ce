"""The shape of a route table. Each API family (`native/`, `openai/`, `anthropic/`, `tinker/`) exports one tuple
of `Endpoint` rows, `ROUTES`; `app.py` joins them into the server's table, which drives everything a route needs
besides its handler's body: aiohttp's registration, who may call it, the body it takes, and the OpenAPI document
(`openapi.py`). A route without a row cannot be served; a row without a route cannot exist.

The table is executed, not only declared: `edge.aiohttp_routes` wraps each handler in its row's rules. The
wrapper finds the caller's `Principal` (a 401 or 429 first), applies the row's `auth` and `scope` (a 403), and
decodes and validates the body as the row's `request` model, or through its `codec` (400 / 413 / 422; a large
body on the body pool, in the caller's slot: api/body_pool.py), and resolves its `resource` for the caller (a
404 for one that is not the caller's, before a body of another `codec` is decoded); the handler is called as
`handler(request, who, body)`, finds the resource in `request[RESOURCE]`, and never looks at a key itself
(`tests/test_auth.py` tries every row).

Who may call (`auth`):
- `public`: no key needed (an `Authorization` header is ignored);
- `key`: any valid key, the admin's or any experiment's;
- `experiment`: the admin key, or the experiment's own key; the experiment is the `{name}` in the path,
  the body's `model` field on the OpenAI- and Anthropic-compatible routes, its `experiment` field on tokenize (which the
  admin key may leave out), or the Tinker model the request names. Another experiment's key is a 403,
  whether or not the experiment exists (names do not leak);
- `admin`: the admin key only (an experiment's key is a 403).
A missing or unknown key is a 401 wherever a key is needed, and too many unknown keys from one address make
every call that needs a key a 429 for a while (`auth_limit.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Literal

from aiohttp import web
from pydantic import BaseModel

from grpo_server.config import RESERVED_NAMES

Auth = Literal["public", "key", "experiment", "admin"]
# The caller the admin key names (edge.caller); any other caller is an experiment's name, and no experiment may
# take this one (config.RESERVED_NAMES): a key of an experiment named so would act as the admin's.
ADMIN = "admin"
assert ADMIN in RESERVED_NAMES


@dataclass(frozen=True)
class Principal:
    """Who calls: the admin key, or one experiment's key. Tagged, so an experiment's name can never be taken
    for the admin (and "admin" is no experiment's name either: config.RESERVED_NAMES)."""

    kind: Literal["admin", "experiment"]
    experiment: str | None = None  # kind "experiment": its name

    @property
    def is_admin(self) -> bool:
        return self.kind == "admin"

    @property
    def owner(self) -> str:
        """The string stores keep for what this caller made (Tinker sessions, models, futures): ADMIN or the
        experiment's name."""
        return ADMIN if self.is_admin else str(self.experiment)

    def may_use(self, experiment: str) -> bool:
        return self.is_admin or self.experiment == experiment


ADMIN_PRINCIPAL = Principal("admin")
RESOURCE = "resource"  # request[RESOURCE]: what the row's `resource` resolved (the Tinker rows' model)
# request[ERROR_SHAPE]: the row's `error_shape`, which the error middleware renders the request's errors in
ERROR_SHAPE = "error_shape"
# How a row's errors are written: "plain" `{"error": {"code", "message"}}`, "openai", OpenAI's error object
# (`type` and `param` besides: what the openai package and the Open Responses spec read), or "anthropic", the
# Messages API's `{"type": "error", "error": {"type", "message"}}` (with our `code`: what the anthropic package reads).
ErrorShape = Literal["plain", "openai", "anthropic"]


@dataclass(frozen=True)
class BodyCodec:
    """A body that is not JSON or msgpack (the Tinker forward_backward's protobuf). `peek` reads what the row's
    `resource` needs (the model it names) without decoding the rest; `decoder(request)` gives the function that
    decodes the whole body within the server's bounds, run on the body pool once the resource is the caller's.
    Both raise ValueError for a malformed body (a 400 naming `describes`); a decoder raises one of `over_limit` for a
    body over its bounds (a 422)."""

    content_type: str
    describes: str  # e.g. "a protobuf tinker_public.ForwardBackwardRequest"
    peek: Callable[[bytes], Any] = field(compare=False)
    decoder: Callable[[web.Request], Callable[[bytes], BaseModel]] = field(compare=False)
    # Decoded in the body pool's process (api/body_pool.py), not on its threads: a decoder written in Python, which
    # would hold the GIL against the event loop. Its decoder then returns something that pickles (a partial of a
    # module-level function), and raises only exceptions that pickle whole (ValueError, `over_limit`'s).
    in_process: bool = False
    # What the decoder raises for a body over the server's bounds: a 422 `over_limit`.
    over_limit: tuple[type[Exception], ...] = ()

# handler(request, who, body): `who` None on public routes, `body` None where the row has no request model.
Handler = Callable[[web.Request, Any, Any], Awaitable[web.StreamResponse]]
JSON = "application/json"
EVENT_STREAM = "text/event-stream"
GZIP = "application/gzip"


@dataclass(frozen=True)
class QueryParameter:
    name: str
    description: str
    schema: dict[str, Any] = field(hash=False)  # (a dict: keeps Endpoint hashable)


@dataclass(frozen=True)
class Endpoint:
    """One route: how it is reached, what it takes and answers, and who may call it."""

    method: str
    path: str
    handler: Handler = field(compare=False)
    request: type[BaseModel] | None  # the JSON/msgpack body, if any
    response: type[BaseModel] | None  # None: no JSON body (204, a file, or this document)
    status: int
    summary: str
    auth: Auth
    errors: tuple[int, ...] = ()  # statuses besides the auth ones and those a body or `{name}` brings
    content_type: str = JSON  # of the success answer
    query: tuple[QueryParameter, ...] = ()  # all optional; a bad value is a 400 (declare it in `errors`)
    events: type[BaseModel] | None = None  # with `stream: true`: server-sent events of these chunks
    events_text: str | None = None  # how the stream goes, where it is not as the chat streams go
    # (status, description) where this route's cause of an error status is not the one openapi.py gives all
    error_text: tuple[tuple[int, str], ...] = ()
    # The operationId, where the one made from the path would be another route's (vLLM's `/tokenize` beside
    # our `/v1/tokenize`: both `post_tokenize`)
    operation: str = ""
    # With auth "experiment" and no `{name}` in the path: the experiment the validated body names (the OpenAI
    # routes' `model`, tokenize's `experiment`). None from it: no experiment named, which only the admin may do.
    scope: Callable[[Any], str | None] | None = field(default=None, compare=False)
    # A body decoded by `codec` instead of as the JSON/msgpack `request` model (which is then None).
    codec: BodyCodec | None = None
    # What the row acts on, found for the caller from the request, the caller and the body (or the codec's peek),
    # before the handler runs: an unknown one or another key's raises its 404 (the Tinker rows' model). The
    # handler reads it in request[RESOURCE].
    resource: Callable[[web.Request, Principal, Any], Any] | None = field(default=None, compare=False)
    error_shape: ErrorShape = "plain"

    @property
    def operation_id(self) -> str:
        if self.operation:
            return self.operation
        words = [w for w in self.path.replace("{", "").replace("}", "").replace(".", "_").split("/") if w]
        return "_".join([self.method.lower()] + [w for w in words if w not in ("v1", "api")])
