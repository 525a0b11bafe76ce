"""The protobuf half of the Tinker wire (SDK 0.38), in plain Python: no protobuf runtime, no tinker import.

The SDK sends `POST /api/v1/forward_backward` as `application/x-protobuf` (always: there is no JSON form) and
rejects a JSON result for a forward/forward_backward/sample future: it asks `retrieve_future` with `Accept:
application/x-protobuf` and decodes `tinker_public.ForwardBackwardOutput` / `tinker_public.SampleResponse`. This
module reads the one request message and writes the two result messages (field numbers from the SDK's
`tinker/proto/tinker_public_pb2.py`; docs/tinker-wire.md has the schema). Arrays travel as little-endian bytes:
tokens int32, logprobs float32, tensor values in their dtype, CSR indices and batch offsets int64.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence

from .data import (
    MAX_DATUMS_PER_CALL,
    Datum,
    DmelChunk,
    EncodedTextChunk,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    ImageChunk,
    ModelInput,
    ProvenanceSpan,
    SampleResponse,
    TensorData,
)

PROTO_CONTENT_TYPE = "application/x-protobuf"

_DTYPE_TO_PROTO = {"float32": 1, "int64": 2}  # tinker_public.DType: 0 unspecified, 1 f32, 2 i64, 3 i32, 4 bf16
_PROTO_TO_DTYPE = {1: "float32", 2: "int64", 3: "int64", 4: "float32"}
_STOP_REASON = {"stop": 0, "length": 1}


# --- byte arrays -------------------------------------------------------------------------------------------------

def _pack(code: str, values: Sequence[float] | Sequence[int]) -> bytes:
    a = array(code, values)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _unpack(code: str, data: bytes) -> list:
    a = array(code)
    if len(data) % a.itemsize:
        raise ValueError(f"{len(data)} bytes is not a whole number of {a.itemsize}-byte values")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


# --- wire format -------------------------------------------------------------------------------------------------

def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32/int64 are written as 10-byte two's complement
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _fields(buf: bytes) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value): an int for varint/fixed, bytes for length-delimited."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(buf, pos)
        elif wire_type == 1:
            value, pos = int.from_bytes(buf[pos:pos + 8], "little"), pos + 8
        elif wire_type == 2:
            size, pos = _read_varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire_type == 5:
            value, pos = int.from_bytes(buf[pos:pos + 4], "little"), pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type}")
        if pos > len(buf):
            raise ValueError("truncated protobuf message")
        yield number, wire_type, value


def _double(bits: int) -> float:
    return struct.unpack("<d", bits.to_bytes(8, "little"))[0]


def _ints(wire_type: int, value: object) -> list[int]:
    """A repeated int64 field's occurrence: packed (one blob) or not (one varint)."""
    if wire_type == 0:
        return [_signed(value)]  # type: ignore[arg-type]
    out, pos, blob = [], 0, value
    while pos < len(blob):  # type: ignore[arg-type]
        v, pos = _read_varint(blob, pos)  # type: ignore[arg-type]
        out.append(_signed(v))
    return out


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _key(number, 2) + _varint(len(data)) + data


def _str_field(number: int, text: str) -> bytes:
    return _bytes_field(number, text.encode())


def _int_field(number: int, value: int) -> bytes:
    return _key(number, 0) + _varint(value)


def _double_field(number: int, value: float) -> bytes:
    return _key(number, 1) + struct.pack("<d", value)


def _packed_ints(number: int, values: Sequence[int]) -> bytes:
    return _bytes_field(number, b"".join(_varint(v) for v in values)) if values else b""


# --- request: ForwardBackwardRequest ---------------------------------------------------------------------------

def _tensor(buf: bytes) -> TensorData:
    dense = b""
    csr: dict[int, bytes] = {}
    dtype_code, shape = 0, []
    for number, wire_type, value in _fields(buf):
        if number == 1:
            dense = value  # type: ignore[assignment]
        elif number == 2:
            csr = {n: v for n, _, v in _fields(value)}  # type: ignore[arg-type,misc]
        elif number == 3:
            dtype_code = value  # type: ignore[assignment]
        elif number == 4:
            shape += _ints(wire_type, value)
    if dtype_code not in (1, 2):
        raise ValueError(f"unsupported tensor dtype {dtype_code} in a request (float32=1 and int64=2 only)")
    dtype = _PROTO_TO_DTYPE[dtype_code]
    code = "f" if dtype == "float32" else "q"
    if csr:
        return TensorData(data=_unpack(code, csr.get(1, b"")), dtype=dtype, shape=shape,
                          sparse_crow_indices=_unpack("q", csr.get(2, b"")),
                          sparse_col_indices=_unpack("q", csr.get(3, b"")))
    values = _unpack(code, dense)
    return TensorData(data=values, dtype=dtype, shape=shape or [len(values)])


def _chunk(buf: bytes) -> EncodedTextChunk | ImageChunk | DmelChunk:
    for number, _, value in _fields(buf):
        sub = dict((n, v) for n, _, v in _fields(value))  # type: ignore[arg-type]
        if number == 1:
            return EncodedTextChunk(tokens=_unpack("i", sub.get(1, b"")))  # type: ignore[arg-type]
        if number == 2:
            expected = sub.get(3)
            return ImageChunk(data=sub.get(1, b""), format=sub.get(2, b"").decode(),  # type: ignore[union-attr]
                              expected_tokens=None if expected is None else _signed(expected))  # type: ignore
        if number == 3:
            return DmelChunk(dmel=sub.get(1, b""))  # type: ignore[arg-type]
    raise ValueError("a model_input chunk with no known kind (encoded_text, image, dmel)")


def _span(buf: bytes) -> ProvenanceSpan:
    for number, _, value in _fields(buf):
        sub = {n: v for n, _, v in _fields(value)}  # type: ignore[arg-type]
        return ProvenanceSpan(kind="prompt" if number == 1 else "sampled",
                              sequence_id=sub.get(1, b"").decode(),  # type: ignore[union-attr]
                              offset=_signed(sub.get(2, 0)), length=_signed(sub.get(3, 0)))  # type: ignore
    raise ValueError("an empty provenance span")


def _datum(buf: bytes) -> Datum:
    chunks, inputs, in_spans, out_spans = [], {}, [], []
    for number, _, value in _fields(buf):
        if number == 1:
            chunks.append(_chunk(value))  # type: ignore[arg-type]
        elif number == 2:
            entry = {n: v for n, _, v in _fields(value)}  # type: ignore[arg-type]
            inputs[entry.get(1, b"").decode()] = _tensor(entry.get(2, b""))  # type: ignore[union-attr,arg-type]
        elif number == 3:
            in_spans.append(_span(value))  # type: ignore[arg-type]
        elif number == 4:
            out_spans.append(_span(value))  # type: ignore[arg-type]
    return Datum(model_input=ModelInput(chunks=chunks), loss_fn_inputs=inputs,
                 model_input_spans=in_spans or None, loss_fn_input_spans=out_spans or None)


def forward_backward_model_id(body: bytes) -> str:
    """The model a forward_backward body names (field 1), read without decoding the rest, so that the caller's
    model is checked before the body's work (a forward_backward of megabytes takes seconds to decode); ValueError
    if it names none."""
    try:
        for number, wire_type, value in _fields(body):
            if number == 1 and wire_type == 2:
                return value.decode()  # type: ignore[union-attr]
    except (UnicodeDecodeError, IndexError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from exc
    raise ValueError("it names no model_id (field 1)")


class OverLimit(Exception):
    """A forward_backward that holds more than its decoder's bounds (api/tinker/routes.py makes it a 422)."""


def decode_forward_backward_request(body: bytes, max_positions: int | None = None,
                                    max_values: int | None = None) -> ForwardBackwardRequest:
    """Parse the body of `POST /api/v1/forward_backward` (decompress `Content-Encoding: zstd` first).

    `loss_fn_config` is read from `loss_fn_config_v2` (numbers and strings) when present, else from the legacy
    float map the SDK writes alongside it. Raises ValueError on a malformed message, whatever is wrong with it:
    a field of another wire type than its number's (an int where bytes belong), a packed run of the wrong
    length, a number out of range (tests/test_fuzz_tinker.py sends all of these).

    Bounds before work: decoding stops with OverLimit as soon as the datums so far hold more than `max_positions`
    token positions or `max_values` dense loss-input values (counted from their shapes), so a body that no call
    may run never becomes more than a call may hold (a 6 MiB body of a million positions decoded to 165 MiB).
    """
    try:
        return _decode_forward_backward_request(body, max_positions, max_values)
    except (AttributeError, TypeError, KeyError, IndexError, struct.error, OverflowError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from exc


def _decode_forward_backward_request(body: bytes, max_positions: int | None,
                                     max_values: int | None) -> ForwardBackwardRequest:
    model_id, loss_fn, seq_id, forward_only = "", "", 0, False
    positions = values = 0
    data: list[Datum] = []
    legacy: dict[str, float] = {}
    v2: dict[str, float | str] = {}
    for number, _, value in _fields(body):
        if number == 1:
            model_id = value.decode()  # type: ignore[union-attr]
        elif number == 2:
            seq_id = _signed(value)  # type: ignore[arg-type]
        elif number == 3:
            datum = _datum(value)  # type: ignore[arg-type]
            data.append(datum)
            positions += datum.model_input.length
            values += sum(t.dense_size for t in datum.loss_fn_inputs.values())
            if len(data) > MAX_DATUMS_PER_CALL or (max_positions is not None and positions > max_positions) \
                    or (max_values is not None and values > max_values):
                raise OverLimit(f"a call holds at most {MAX_DATUMS_PER_CALL} datums, {max_positions} token positions and "
                                f"{max_values} loss input values; this one reached {len(data)} datums, {positions} "
                                f"positions and {values} values when decoding stopped: split the batch")
        elif number == 4:
            loss_fn = value.decode()  # type: ignore[union-attr]
        elif number == 5:
            entry = {n: v for n, _, v in _fields(value)}  # type: ignore[arg-type]
            legacy[entry.get(1, b"").decode()] = _double(entry.get(2, 0))  # type: ignore[union-attr,arg-type]
        elif number == 6:
            forward_only = bool(value)
        elif number == 7:
            entry = {n: v for n, _, v in _fields(value)}  # type: ignore[arg-type]
            tagged = {n: v for n, _, v in _fields(entry.get(2, b""))}  # type: ignore[arg-type]
            key = entry.get(1, b"").decode()  # type: ignore[union-attr]
            v2[key] = tagged[2].decode() if 2 in tagged else _double(tagged.get(1, 0))  # type: ignore
    config: dict[str, float | str] | None = v2 or dict(legacy) or None
    return ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id or None, forward_only=forward_only,
        forward_backward_input=ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config))


# --- results: ForwardBackwardOutput, SampleResponse -------------------------------------------------------------

def _tensor_message(t: TensorData) -> bytes:
    code = "f" if t.dtype == "float32" else "q"
    if t.sparse_crow_indices is not None:
        csr = (_bytes_field(1, _pack(code, t.data)) + _bytes_field(2, _pack("q", t.sparse_crow_indices))
               + _bytes_field(3, _pack("q", t.sparse_col_indices or [])))
        body = _bytes_field(2, csr)
    else:
        body = _bytes_field(1, _pack(code, t.data))
    return body + _int_field(3, _DTYPE_TO_PROTO[t.dtype]) + _packed_ints(4, t.shape or [len(t.data)])


def encode_forward_backward_output(out: ForwardBackwardOutput) -> bytes:
    """The `retrieve_future` body (content type `application/x-protobuf`) of a forward/forward_backward result.

    Every datum must carry the same field names; a field's per-datum tensors must share dtype and trailing
    shape (all 1-D `[N_i]` for the built-in losses). Metric names need a `:reduction` suffix (`loss:sum`).
    """
    msg = _str_field(1, out.loss_fn_output_type)
    if out.loss_fn_outputs:
        names = list(out.loss_fn_outputs[0])
        record = _str_field(1, out.loss_fn_output_type)
        for name in names:
            tensors = [datum[name] for datum in out.loss_fn_outputs]
            dtype = tensors[0].dtype
            trailing = (tensors[0].shape or [len(tensors[0].data)])[1:]
            code, size = ("f", 4) if dtype == "float32" else ("q", 8)
            offsets, blobs, total = [0], [], 0
            for t in tensors:
                if t.dtype != dtype or (t.shape or [len(t.data)])[1:] != trailing or t.sparse_crow_indices:
                    raise ValueError(f"loss_fn_outputs[*][{name!r}] differ in dtype or trailing shape, or are sparse")
                blobs.append(_pack(code, t.data))
                total += len(t.data) * size
                offsets.append(total)
            batched = (_bytes_field(1, b"".join(blobs)) + _bytes_field(2, _pack("q", offsets))
                       + _int_field(3, _DTYPE_TO_PROTO[dtype]) + _packed_ints(4, trailing))
            record += _bytes_field(2, _str_field(1, name) + _bytes_field(2, batched))
        record += _int_field(3, len(out.loss_fn_outputs))
        msg += _bytes_field(2, record)
    for key, value in out.metrics.items():
        if ":" not in key:
            raise ValueError(f"metric {key!r} needs a ':reduction' suffix (the SDK splits on ':')")
        msg += _bytes_field(3, _str_field(1, key) + _double_field(2, float(value)))
    return msg


def _topk(rows: Sequence[Sequence[tuple[int, float]] | None]) -> bytes:
    k = max((len(row) for row in rows if row), default=1)
    ids: list[int] = []
    lps: list[float] = []
    for row in rows:
        cells = list(row or [])[:k]
        ids += [tok for tok, _ in cells] + [0] * (k - len(cells))
        lps += [lp for _, lp in cells] + [-99999.0] * (k - len(cells))
    return (_bytes_field(1, _pack("i", ids)) + _bytes_field(2, _pack("f", lps))
            + _int_field(3, k) + _int_field(4, len(rows)))


def encode_sample_response(resp: SampleResponse) -> bytes:
    """The `retrieve_future` body (content type `application/x-protobuf`) of a sample (asample) result.

    `tokens` must include the stop token or stop-string tokens that ended a `stop` sequence (cookbook renderers
    look for them); send `logprobs` for every sequence (cookbook's RL loop asserts they are present). A None
    prompt logprob (position 0, or before `prompt_logprobs_last_n`) travels as NaN.
    """
    msg = b""
    for seq in resp.sequences:
        body = _int_field(1, _STOP_REASON[seq.stop_reason]) + _bytes_field(2, _pack("i", seq.tokens))
        if seq.logprobs is not None:
            body += _bytes_field(3, _pack("f", seq.logprobs))
        if seq.topk_logprobs is not None:
            body += _bytes_field(4, _topk(seq.topk_logprobs))
        msg += _bytes_field(1, body)
    if resp.prompt_logprobs is not None:
        msg += _bytes_field(2, _pack("f", [math.nan if lp is None else lp for lp in resp.prompt_logprobs]))
    if resp.topk_prompt_logprobs is not None:
        msg += _bytes_field(3, _topk(resp.topk_prompt_logprobs))
    if resp.prompt_cache_hit_tokens:
        msg += _int_field(4, resp.prompt_cache_hit_tokens)
    if resp.target_prompt_logprobs is not None:
        msg += _bytes_field(5, _tensor_message(resp.target_prompt_logprobs))
    return msg
