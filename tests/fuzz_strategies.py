"""What tests/test_fuzz.py sends beside schemathesis: bodies and requests that no OpenAPI schema describes, so
schemathesis (which draws values from the schemas and serializes them itself) never sends them:

- bytes that are not JSON or msgpack at all, JSON nested 100,000 deep (a RecursionError in json.loads was a
  500), lone UTF-16 surrogates written as JSON escapes or as raw bytes (the sampler call's msgpack could not
  encode them), msgpack garbage (huge declared lengths, reserved bytes), a body over `max_body_bytes`;
- a body under a content type it is not in (JSON as text/plain, form data, another charset);
- JSON's NaN and Infinity, which Python's parser takes and schemathesis never writes;
- experiment names outside the path parameter's pattern and its URL encoding (unicode, %-escapes);
- query strings as raw text (repeated, undeclared and broken parameters);
- keys that are not keys: no header, another scheme, any text.

test_raw sends them (`raw_cases`); what schemathesis sends, and how the tests edit it, is tests/fuzz_schema.py's.
"""

from __future__ import annotations

import json
import string
import urllib.parse
from dataclasses import dataclass, field

import msgpack
from hypothesis import strategies as st

from tests.serving import ADMIN_KEY

FUZZ_EXP = "fuzz-target"
FUZZ_KEY = "key-fuzz-target-5c2e"
MSGPACK = "application/msgpack"

HEADER_TEXT = st.text(alphabet=string.ascii_letters + string.digits + string.punctuation + " ", max_size=40)

LONE_SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(10 ** 30), max_value=10 ** 30),
    st.floats(), st.sampled_from([1e308, -1e308, 5e-324, 2 ** 63, -2 ** 63 - 1, 2 ** 64]),
    st.text(max_size=30), st.text(alphabet=LONE_SURROGATE, max_size=3),
)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=12)


def _pack(value) -> bytes | None:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return None


CONTENT_TYPES = st.sampled_from(["application/json", "text/plain", None, "application/x-www-form-urlencoded",
                                 "application/json; charset=latin-1", "multipart/form-data; boundary=x"])


@st.composite
def encoded(draw, value) -> tuple[bytes, str | None]:
    """Any JSON value (NaN, Infinity and lone surrogates included: `json.dumps` writes them) or its msgpack."""
    if draw(st.booleans()):
        packed = _pack(value)
        if packed is not None:
            return packed, MSGPACK
    return json.dumps(value).encode(), draw(CONTENT_TYPES)


deep = st.integers(1, 100_000).map(lambda d: ("[" * d + "]" * d).encode())
deep_objects = st.integers(1, 50_000).map(lambda d: ('{"a":' * d + "1" + "}" * d).encode())
junk_bytes = st.one_of(
    st.binary(max_size=200),
    deep, deep_objects,
    st.sampled_from([b"", b"{", b"null", b"1e999", b"-", b"\xef\xbb\xbf{}", b'{"a":1}{"b":2}', b"\x00" * 10,
                     '{"prompt": "\\ud800"}'.encode(), b'{"prompt": "\xed\xa0\x80"}', "{}".encode("utf-16"),
                     b"[" * 10 ** 6, b'{"n": NaN, "max_tokens": Infinity}']),
    st.just(b"x" * (9 * 1024 * 1024)),  # over max_body_bytes
)
msgpack_garbage = st.one_of(st.binary(max_size=200),
                            st.sampled_from([b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xc1",
                                             b"\xd4\xff\x00", b"\xc7\x05\xff\x00", b"\x91" * 100_000]))
bodies = st.one_of(
    json_values.flatmap(encoded),
    st.tuples(junk_bytes, CONTENT_TYPES),
    st.tuples(msgpack_garbage, st.just(MSGPACK)),
)

OTHER_NAMES = st.one_of(st.just("no-such-experiment"), st.text(max_size=80),
                        st.text(alphabet="%./\\?#&=+ \x00\u00e9\u4e2d", max_size=12)).filter(
    lambda n: n.strip(".") != "" or n == "")
# ("." and ".." are not names: the URL's dot segments take the request to another route.)

query_strings = st.one_of(
    st.builds(urllib.parse.urlencode, st.lists(st.tuples(
        st.sampled_from(["version", "kind", "limit", "x"]),
        st.one_of(st.integers(-3, 3).map(str), st.integers().map(str), st.text(max_size=20))), max_size=3)),
    st.text(alphabet=string.ascii_letters + string.digits + "%&=;+-_.~[]", max_size=30),
)

BAD_AUTH = st.one_of(
    st.just({}),
    st.just({"Authorization": "Bearer wrong-key"}),
    HEADER_TEXT.map(lambda token: {"Authorization": f"Bearer {token}"}),
    HEADER_TEXT.map(lambda value: {"Authorization": value}),
)
auth = st.one_of(st.just({"Authorization": f"Bearer {ADMIN_KEY}"}), st.just({"Authorization": f"Bearer {FUZZ_KEY}"}),
                 BAD_AUTH)


@dataclass
class RawCase:
    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    data: bytes | None = None

    def __repr__(self) -> str:  # hypothesis prints the falsifying case: keep a 9 MiB body short
        data = None if self.data is None else (self.data[:300] + b"..." if len(self.data) > 300 else self.data)
        return f"RawCase({self.method} {self.path!r}, headers={self.headers!r}, data={data!r})"


@st.composite
def raw_cases(draw, method: str, path: str) -> RawCase:
    """A request to one operation that schemathesis would not write: junk body, odd name, raw query, odd key."""
    if "{name}" in path:
        ends_it = method == "DELETE" or path.endswith("/pause")  # the fuzz target must go on sampling
        name = FUZZ_EXP if not ends_it and draw(st.booleans()) else draw(OTHER_NAMES)
        path = path.replace("{name}", urllib.parse.quote(name, safe=""))
    query = draw(query_strings)
    headers = dict(draw(st.sampled_from(["admin", "admin", "any"]).flatmap(
        lambda who: st.just({"Authorization": f"Bearer {ADMIN_KEY}"}) if who == "admin" else auth)))
    data, content_type = draw(bodies) if method == "POST" or draw(st.booleans()) else (None, None)
    if content_type is not None:
        headers["Content-Type"] = content_type
    if draw(st.booleans()):
        headers["Accept"] = MSGPACK
    return RawCase(method, path + (f"?{query}" if query else ""), headers, data)
