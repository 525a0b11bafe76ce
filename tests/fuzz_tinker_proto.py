"""Hypothesis strategies for the Tinker `forward_backward` body: protobuf (`tinker_public.ForwardBackwardRequest`),
which no OpenAPI document describes, so schemathesis cannot fuzz it (tests/test_fuzz_tinker.py).

Bodies are built with the official SDK's own generated protobuf classes (`tinker.proto.tinker_public_pb2`), so they
are what a real client can send, including what its pydantic types would refuse: shapes that do not match the
values, CSR indices out of range, dimensions of 2^40, unknown dtypes and losses, NaN configs, tokens outside the
vocabulary, empty datums. A share of the cases are then broken at the byte level (cut, flipped, spliced) or are
random bytes, for the decoder itself.

Not fuzzed: `seq_id`. A call with a seq_id ahead of its model's lane waits for the gap (runtime futures: up to
120 s) by design, and a passed one is refused at once: both are tested in tests/test_futures.py.
"""

from __future__ import annotations

import struct

from hypothesis import strategies as st
from tinker.proto import tinker_public_pb2 as pb

LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "no_such_loss", ""]
INPUT_KEYS = ["target_tokens", "weights", "advantages", "logprobs", "mask", ""]
DTYPES = [pb.DTYPE_FLOAT32, pb.DTYPE_INT64, pb.DTYPE_INT32, pb.DTYPE_BFLOAT16, pb.DTYPE_UNSPECIFIED, 7]


def _packed(fmt: str, values: list) -> bytes:
    return struct.pack(f"<{len(values)}{fmt}", *values)


def _token_bytes(vocab: int) -> st.SearchStrategy[bytes]:
    ids = st.lists(st.one_of(st.integers(0, vocab - 1), st.integers(-(2**31), 2**31 - 1)), max_size=24)
    return st.one_of(ids.map(lambda v: _packed("i", v)), st.binary(max_size=12))


def _dims() -> st.SearchStrategy[list[int]]:
    small = st.integers(0, 24)
    return st.one_of(st.lists(small, max_size=3), st.lists(st.one_of(small, st.integers(-(2**40), 2**40)),
                                                           max_size=6))


@st.composite
def tensors(draw, vocab: int) -> pb.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(_dims())
    count = draw(st.integers(0, 24))
    if dtype == pb.DTYPE_INT64:
        values = _packed("q", draw(st.lists(st.integers(-2, vocab + 2), min_size=count, max_size=count)))
    else:
        floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
        values = _packed("f", draw(st.lists(floats, min_size=count, max_size=count)))
    if draw(st.booleans()):
        values = values[:draw(st.integers(0, len(values)))]  # a length no dtype divides, sometimes
    if draw(st.integers(0, 3)) == 0:
        crow = draw(st.lists(st.integers(-3, 30), max_size=6))
        col = draw(st.lists(st.integers(-3, 2**40), max_size=count + 2))
        return pb.Tensor(dtype=dtype, shape=shape, sparse_csr=pb.SparseCsr(
            values=values, crow_indices=_packed("q", crow), col_indices=_packed("q", col)))
    return pb.Tensor(dtype=dtype, shape=shape, dense=values)


@st.composite
def datums(draw, vocab: int) -> pb.Datum:
    chunks = [pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=draw(_token_bytes(vocab))))
              for _ in range(draw(st.integers(0, 2)))]
    keys = draw(st.lists(st.sampled_from(INPUT_KEYS), max_size=4, unique=True))
    return pb.Datum(model_input=chunks, loss_fn_inputs={k: draw(tensors(vocab)) for k in keys})


@st.composite
def valid_datums(draw, vocab: int) -> pb.Datum:
    """A datum the server trains on (next-token cross entropy): what the random ones are measured against."""
    n = draw(st.integers(1, 8))
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    targets = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    weights = draw(st.lists(st.floats(0, 1, width=32), min_size=n, max_size=n))
    return pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=_packed("i", tokens)))],
                    loss_fn_inputs={"target_tokens": pb.Tensor(dtype=pb.DTYPE_INT64, shape=[n],
                                                               dense=_packed("q", targets)),
                                    "weights": pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[n],
                                                         dense=_packed("f", weights))})


@st.composite
def requests(draw, model_id: str, vocab: int) -> bytes:
    """A whole request's bytes: a valid call, or one of valid structure and random content, sometimes broken at
    the byte level."""
    valid = draw(st.integers(0, 3)) == 0
    message = pb.ForwardBackwardRequest(
        model_id=model_id if valid else draw(st.sampled_from([model_id] * 6 + ["", "sess-0:train:0", "x" * 300])),
        data=draw(st.lists(valid_datums(vocab) if valid else st.one_of(datums(vocab), valid_datums(vocab)),
                           min_size=1 if valid else 0, max_size=3)),
        loss_fn="cross_entropy" if valid else draw(st.sampled_from(LOSSES)),
        loss_fn_config={} if valid else draw(st.dictionaries(st.sampled_from(["clip_low_threshold", "clip_high_threshold", "beta",
                                                             ""]), st.floats(), max_size=2)),
        forward_only=draw(st.booleans()))
    body = message.SerializeToString()
    how = 9 if valid else draw(st.integers(0, 9))
    if how == 0:  # cut short
        return body[:draw(st.integers(0, max(0, len(body) - 1)))]
    if how == 1 and body:  # one byte changed
        at = draw(st.integers(0, len(body) - 1))
        return body[:at] + bytes([draw(st.integers(0, 255))]) + body[at + 1:]
    if how == 2:  # bytes spliced in
        at = draw(st.integers(0, len(body)))
        return body[:at] + draw(st.binary(min_size=1, max_size=16)) + body[at:]
    if how == 3:
        return draw(st.binary(max_size=64))
    return body
