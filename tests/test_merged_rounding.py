"""sampler/merged_weights.py's rounding of a merged weight into a bfloat16 engine: small updates to a model stored
in bf16 (every base weight on the bf16 grid, as SmolLM2's) survive in expectation, where round to nearest
drops each one under half a grid step."""

from __future__ import annotations

import pytest
import torch

from sampler.bf16_rounding import RoundingNoise, stochastic_round_bf16


def _rounded(weight: torch.Tensor, seed: int, noise: RoundingNoise | None = None) -> torch.Tensor:
    noise = noise or RoundingNoise(2 * weight.numel())
    return stochastic_round_bf16(weight, noise.take(weight.shape, torch.Generator().manual_seed(seed)))


def _on_grid(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=generator).to(torch.bfloat16).to(torch.float32)  # a bf16 model's weights


def test_a_small_update_survives_stochastic_rounding_in_expectation_where_round_to_nearest_drops_it():
    base = _on_grid(200_000, seed=0)
    ulp = 2.0 ** (torch.floor(torch.log2(base.abs())) - 7)  # one bf16 grid step at each weight (7 mantissa bits)
    delta = 0.2 * ulp * base.sign()  # away from zero, so the next grid point up is one step away
    merged = base + delta
    nearest = merged.to(torch.bfloat16).float()
    assert torch.equal(nearest, base)  # every update is under half a step: round to nearest loses all of them
    served = _rounded(merged, seed=2).float()
    moved = served - base
    # Each weight lands on one of its two neighbours (the step itself for the ones rounded up) ...
    assert torch.all((moved == 0) | torch.isclose(moved.abs(), ulp, rtol=1e-3))
    # ... and along the update they move by it on average: the response to the update is 1, not 0.
    response = (moved * delta.sign()).sum() / (delta * delta.sign()).sum()
    assert 0.97 < response.item() < 1.03, response


def test_weights_on_the_grid_stay_exact_and_a_seed_gives_the_same_weights():
    base = _on_grid(10_000, seed=3)
    assert torch.equal(_rounded(base, seed=4).float(), base)
    merged = base + 1e-4 * torch.randn(base.shape, generator=torch.Generator().manual_seed(5))
    one = _rounded(merged, seed=6)
    assert torch.equal(one, _rounded(merged, seed=6))  # a version merged again is the same weights
    assert torch.all((one.float() - merged).abs() <= merged.abs() * 2.0**-7 + 1e-30)  # within one grid step


def test_each_version_takes_independent_noise_from_the_one_table():
    """The noise is a window of one table drawn once (a merge's cost: sampler/merged_weights.py), at an offset
    drawn per version: two versions' roundings of weights half a step off the grid disagree about half the time,
    as two independent draws would."""
    noise = RoundingNoise(1_000_000)
    base = _on_grid(100_000, seed=7)
    ulp = 2.0 ** (torch.floor(torch.log2(base.abs())) - 7)
    merged = base + 0.5 * ulp * base.sign()
    one, other = _rounded(merged, seed=8, noise=noise), _rounded(merged, seed=9, noise=noise)
    disagree = (one != other).float().mean().item()
    assert 0.47 < disagree < 0.53, disagree
    with pytest.raises(ValueError):
        noise.take((1_000_001,), torch.Generator())  # a window larger than the table
