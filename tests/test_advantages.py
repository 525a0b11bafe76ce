"""Group-relative advantages against hand-computed numbers."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from grpo_server.runtime.advantages import group_advantages, is_zero_variance, scale_by_std_for


def test_grpo_scales_by_sample_std() -> None:
    # [1, 2, 3]: mean 2, centred [-1, 0, 1], sample var (1 + 0 + 1) / (3 - 1) = 1 -> std 1
    assert group_advantages([1.0, 2.0, 3.0], scale_by_std=True, eps=0.0) == pytest.approx([-1.0, 0.0, 1.0])
    # with eps 1e-4: +-1 / 1.0001
    expected = [-1 / 1.0001, 0.0, 1 / 1.0001]
    assert group_advantages([1.0, 2.0, 3.0], scale_by_std=True) == pytest.approx(expected)


def test_grpo_binary_rewards() -> None:
    # [1, 0, 0, 1]: mean 0.5, centred +-0.5, sample var 4 * 0.25 / 3 = 1/3, std 0.5773503
    # 0.5 / (0.5773503 + 1e-4) = 0.8658754 (a population std, 0.5, would give ~1.0)
    adv = group_advantages([1, 0, 0, 1], scale_by_std=True)
    assert adv == pytest.approx([0.8658754, -0.8658754, -0.8658754, 0.8658754], rel=1e-6)


def test_dr_grpo_only_centres() -> None:
    # mean of [1, 0, 0, 1] is 0.5; no std division
    assert group_advantages([1, 0, 0, 1], scale_by_std=False) == [0.5, -0.5, -0.5, 0.5]
    # [10, 20]: mean 15 -> [-5, 5] (std would have been 7.07)
    assert group_advantages([10.0, 20.0], scale_by_std=False) == [-5.0, 5.0]


def test_zero_variance_group_gives_zeros() -> None:
    # Every reward equal: centred values are 0, and 0 / (0 + eps) stays 0 (no blow-up).
    assert group_advantages([0.5, 0.5, 0.5], scale_by_std=True) == [0.0, 0.0, 0.0]
    assert is_zero_variance([0.5, 0.5, 0.5])
    assert is_zero_variance([1.0, 1.0 + 1e-12])
    assert not is_zero_variance([0.0, 1.0])
    assert not is_zero_variance([0.0, 0.0, 1e-6])


def test_group_of_one() -> None:
    assert group_advantages([3.7], scale_by_std=True) == [0.0]
    assert group_advantages([3.7], scale_by_std=False) == [0.0]
    assert is_zero_variance([3.7])


def test_scale_by_std_for() -> None:
    assert scale_by_std_for("dr_grpo") is False
    for loss_type in ("grpo", "dapo", "gspo"):
        assert scale_by_std_for(loss_type) is True


def test_non_finite_rewards_rejected() -> None:
    with pytest.raises(ValueError):
        group_advantages([1.0, math.nan], scale_by_std=True)
    with pytest.raises(ValueError):
        is_zero_variance([math.inf, 1.0])


def test_no_numeric_imports() -> None:
    # The front end and client install have no numpy / torch: importing must not pull them in.
    code = "import sys, grpo_server.runtime.advantages; print('numpy' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
