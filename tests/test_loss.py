"""GRPO-family losses against hand-computed numbers (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.policy_loss import BatchNormalizer, LossSettings, policy_loss, token_logprobs

# clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28] unless a test says otherwise
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def settings(loss_type: str, beta: float = 0.0, clip_high: float = CLIP_HIGH) -> LossSettings:
    return LossSettings(loss_type=loss_type, clip_low=CLIP_LOW, clip_high=clip_high, beta=beta)


def logps_with_ratios(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, old_logp) whose per-token ratio exp(logp - old) is `ratios`; logp is a grad leaf."""
    old = torch.tensor([[-1.0, -2.0, -0.5]] * len(ratios))
    logp = (old + torch.tensor(ratios).log()).requires_grad_()
    return logp, old


def approx(x: float, rel: float = 1e-5):
    return pytest.approx(x, rel=rel, abs=1e-7)


# ----------------------------------------------------------------------------------------------
# Ratios inside the clip range: the objective is plain r * A.
# seq0: r = [1.1, 0.9, 1.0], A = +1  -> token losses -1.1, -0.9, -1.0   (sum -3.0, mean -1.0)
# seq1: r = [1.2, 1.0, pad], A = -2  -> token losses  2.4,  2.0         (sum  4.4, mean  2.2)
# ----------------------------------------------------------------------------------------------
INSIDE_RATIOS = [[1.1, 0.9, 1.0], [1.2, 1.0, 1.0]]
INSIDE_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
INSIDE_ADV = torch.tensor([1.0, -2.0])
INSIDE_NORM = BatchNormalizer(num_sequences=2, num_tokens=5, max_tokens=4)


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", (-1.0 + 2.2) / 2),  # per-sequence means summed / 2 sequences = 0.6
        ("dr_grpo", (-3.0 + 4.4) / (2 * 4)),  # token sum / (2 sequences * 4 max_tokens) = 0.175
        ("dapo", (-3.0 + 4.4) / 5),  # token sum / 5 tokens = 0.28
    ],
)
def test_token_level_losses_inside_clip_range(loss_type: str, expected: float) -> None:
    logp, old = logps_with_ratios(INSIDE_RATIOS)
    loss, stats = policy_loss(logp, old, INSIDE_ADV, INSIDE_MASK, settings(loss_type), INSIDE_NORM)
    assert loss.item() == approx(expected)
    assert stats["clipped_count"].item() == 0
    assert stats["token_count"].item() == 5
    assert stats["seq_count"].item() == 2
    # 1.1 + 0.9 + 1.0 + 1.2 + 1.0 = 5.2 ; squares 1.21 + 0.81 + 1 + 1.44 + 1 = 5.46
    assert stats["ratio_sum"].item() == approx(5.2)
    assert stats["ratio_sq_sum"].item() == approx(5.46)
    assert stats["ratio_min"].item() == approx(0.9)
    assert stats["ratio_max"].item() == approx(1.2)
    assert stats["kl_sum"].item() == 0.0


def test_grpo_gradient_inside_clip_range() -> None:
    # d(-r A / len / N) / d logp = -r A / (len N):
    # seq0 tok0: -1.1 * 1 / (3 * 2) ; seq1 tok0: 1.2 * 2 / (2 * 2)
    logp, old = logps_with_ratios(INSIDE_RATIOS)
    loss, _ = policy_loss(logp, old, INSIDE_ADV, INSIDE_MASK, settings("grpo"), INSIDE_NORM)
    loss.backward()
    assert logp.grad[0, 0].item() == approx(-1.1 / 6)
    assert logp.grad[1, 0].item() == approx(2.4 / 4)
    assert logp.grad[1, 2].item() == 0.0  # padding


# ----------------------------------------------------------------------------------------------
# Clipping active, clip range [0.8, 1.28], no padding:
# seq0, A = +1, r = [1.5, 0.5, 1.25]:
#   1.5  -> min(1.5, 1.28) = 1.28   clipped (A > 0, above the upper bound)
#   0.5  -> min(0.5, 0.8)  = 0.5    not clipped (A > 0: a low ratio is not bounded)
#   1.25 -> 1.25                    inside thanks to clip-higher (would be clipped at 1.2)
#   objective sum 3.03
# seq1, A = -1, r = [1.5, 0.5, 0.85]:
#   1.5  -> min(-1.5, -1.28) = -1.5 not clipped (A < 0: a high ratio is not bounded)
#   0.5  -> min(-0.5, -0.8)  = -0.8 clipped (A < 0, below the lower bound)
#   0.85 -> -0.85                   inside
#   objective sum -3.15
# ----------------------------------------------------------------------------------------------
CLIP_RATIOS = [[1.5, 0.5, 1.25], [1.5, 0.5, 0.85]]
CLIP_MASK = torch.ones(2, 3)
CLIP_ADV = torch.tensor([1.0, -1.0])
CLIP_NORM = BatchNormalizer(num_sequences=2, num_tokens=6, max_tokens=3)


def test_grpo_clipping_both_signs() -> None:
    logp, old = logps_with_ratios(CLIP_RATIOS)
    loss, stats = policy_loss(logp, old, CLIP_ADV, CLIP_MASK, settings("grpo"), CLIP_NORM)
    # -(3.03 / 3 + (-3.15) / 3) / 2 = 0.02
    assert loss.item() == approx(0.02, rel=1e-4)
    assert stats["clipped_count"].item() == 2
    assert stats["ratio_min"].item() == approx(0.5)
    assert stats["ratio_max"].item() == approx(1.5)
    loss.backward()
    # Clipped tokens get no gradient; the others get -r A / (len N) = -r A / 6.
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[1, 1].item() == 0.0
    assert logp.grad[0, 1].item() == approx(-0.5 / 6)  # A > 0, r = 0.5
    assert logp.grad[1, 0].item() == approx(1.5 / 6)  # A < 0, r = 1.5: pushed down, unbounded
    assert logp.grad[0, 2].item() == approx(-1.25 / 6)  # inside [0.8, 1.28]


def test_clip_higher_asymmetry() -> None:
    # Symmetric clip 0.2: seq0's 1.25 is now clipped to 1.2 -> seq0 objective 1.2 + 0.5 + 1.2 = 2.9
    # loss = -(2.9 / 3 - 3.15 / 3) / 2 = 0.25 / 6
    logp, old = logps_with_ratios(CLIP_RATIOS)
    loss, stats = policy_loss(logp, old, CLIP_ADV, CLIP_MASK, settings("grpo", clip_high=0.2), CLIP_NORM)
    assert loss.item() == approx(0.25 / 6, rel=1e-4)
    assert stats["clipped_count"].item() == 3
    loss.backward()
    assert logp.grad[0, 2].item() == 0.0


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("dr_grpo", -(3.03 - 3.15) / (2 * 3)),  # token sum 0.12 / (2 * 3) = 0.02
        ("dapo", -(3.03 - 3.15) / 6),  # token sum 0.12 / 6 tokens = 0.02
    ],
)
def test_token_level_clipping(loss_type: str, expected: float) -> None:
    logp, old = logps_with_ratios(CLIP_RATIOS)
    loss, stats = policy_loss(logp, old, CLIP_ADV, CLIP_MASK, settings(loss_type), CLIP_NORM)
    assert loss.item() == approx(expected, rel=1e-4)
    assert stats["clipped_count"].item() == 2


# ----------------------------------------------------------------------------------------------
# GSPO: one ratio per sequence, s = exp(mean log-ratio over valid tokens).
# seq0: log-ratios [0.1, 0.2, 0.0]  -> mean 0.1,  s = e^0.1  = 1.1051709, A = +1: inside -> 1.1051709
# seq1: log-ratios [0.6, 0.4, pad]  -> mean 0.5,  s = e^0.5  = 1.6487213, A = +2: clipped -> 1.28 * 2 = 2.56
# seq2: log-ratios [-0.6, -0.4, pad]-> mean -0.5, s = e^-0.5 = 0.6065307, A = -1: clipped -> -0.8
# loss = -(1.1051709 + 2.56 - 0.8) / 3 = -0.9550570
# ----------------------------------------------------------------------------------------------
def test_gspo_sequence_ratio() -> None:
    old = torch.full((3, 3), -1.0)
    log_ratio = torch.tensor([[0.1, 0.2, 0.0], [0.6, 0.4, 9.0], [-0.6, -0.4, -9.0]])
    logp = (old + log_ratio).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]])
    adv = torch.tensor([1.0, 2.0, -1.0])
    norm = BatchNormalizer(num_sequences=3, num_tokens=7, max_tokens=3)
    loss, stats = policy_loss(logp, old, adv, mask, settings("gspo"), norm)
    s0, s1, s2 = math.exp(0.1), math.exp(0.5), math.exp(-0.5)
    assert loss.item() == approx(-(s0 + 2.56 - 0.8) / 3)
    assert stats["clipped_count"].item() == 4  # the 2 tokens of seq1 and the 2 of seq2
    assert stats["ratio_sum"].item() == approx(3 * s0 + 2 * s1 + 2 * s2)
    assert stats["ratio_sq_sum"].item() == approx(3 * s0**2 + 2 * s1**2 + 2 * s2**2)
    assert stats["ratio_min"].item() == approx(s2)
    assert stats["ratio_max"].item() == approx(s1)
    loss.backward()
    # The gradient flows through the mean: each of seq0's tokens gets -s A / (len N) = -s0 / 9.
    assert torch.allclose(logp.grad[0], torch.full((3,), -s0 / 9))
    # Clipped sequences and padding get none.
    assert torch.count_nonzero(logp.grad[1:]).item() == 0


def test_gspo_differs_from_token_ratio() -> None:
    # Token ratios [e^0.5, e^-0.5] with A = 1: per token, 1.6487 clips to 1.28 and 0.6065 stays
    # (A > 0): grpo objective mean (1.28 + 0.6065307) / 2. GSPO: mean log-ratio 0 -> s = 1 -> objective 1.
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.5, -0.5]])
    mask = torch.ones(1, 2)
    adv = torch.tensor([1.0])
    norm = BatchNormalizer(num_sequences=1, num_tokens=2, max_tokens=2)
    gspo, gspo_stats = policy_loss(logp, old, adv, mask, settings("gspo"), norm)
    grpo, _ = policy_loss(logp, old, adv, mask, settings("grpo"), norm)
    assert gspo.item() == approx(-1.0)
    assert grpo.item() == approx(-(1.28 + math.exp(-0.5)) / 2)
    assert gspo_stats["clipped_count"].item() == 0


def test_gspo_empty_sequence_contributes_nothing() -> None:
    # An all-padding row would otherwise have s = 1 and add -A / N to the loss.
    old = torch.zeros(2, 2)
    logp = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [0, 0]])
    norm = BatchNormalizer(num_sequences=2, num_tokens=2, max_tokens=2)
    loss, _ = policy_loss(logp, old, torch.tensor([1.0, 5.0]), mask, settings("gspo"), norm)
    assert loss.item() == approx(-1.0 / 2)  # only seq0: -(1 * 1) / 2


# ----------------------------------------------------------------------------------------------
# KL to the base model, k3 estimator: kl = exp(d) - d - 1 with d = ref - logp.
# seq0: logp [-1, -2, pad], ref [-1.5, -1, wild] -> d = [-0.5, 1.0] -> kl = [0.1065307, 0.7182818]
# seq1: logp [-1, -1, -1],  ref [-0.5, -1, -1]   -> d = [0.5, 0, 0]   -> kl = [0.1487213, 0, 0]
# kl_sum = 0.9735338. A = 0, so the policy term is 0 and the loss is beta * aggregated kl.
# ----------------------------------------------------------------------------------------------
KL_LOGP = [[-1.0, -2.0, 50.0], [-1.0, -1.0, -1.0]]
KL_REF = torch.tensor([[-1.5, -1.0, -60.0], [-0.5, -1.0, -1.0]])
KL_MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
KL_NORM = BatchNormalizer(num_sequences=2, num_tokens=5, max_tokens=4)
K0, K1, K2 = math.exp(-0.5) - 0.5, math.e - 2.0, math.exp(0.5) - 1.5


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", 0.1 * ((K0 + K1) / 2 + K2 / 3) / 2),  # 0.0230990
        ("gspo", 0.1 * ((K0 + K1) / 2 + K2 / 3) / 2),  # gspo aggregates kl like grpo
        ("dr_grpo", 0.1 * (K0 + K1 + K2) / (2 * 4)),  # 0.0121692
        ("dapo", 0.1 * (K0 + K1 + K2) / 5),  # 0.0194707
    ],
)
def test_kl_value(loss_type: str, expected: float) -> None:
    logp = torch.tensor(KL_LOGP, requires_grad=True)
    old = logp.detach().clone()
    loss, stats = policy_loss(
        logp, old, torch.zeros(2), KL_MASK, settings(loss_type, beta=0.1), KL_NORM, ref_logp_B_T=KL_REF
    )
    assert loss.item() == approx(expected)
    assert stats["kl_sum"].item() == approx(K0 + K1 + K2)  # 0.9735338
    if loss_type == "grpo":
        loss.backward()
        # d kl / d logp = 1 - exp(d); seq0 tok0: beta * (1 - e^-0.5) / (len 2 * N 2)
        assert logp.grad[0, 0].item() == approx(0.1 * (1 - math.exp(-0.5)) / 4)
        assert logp.grad[0, 2].item() == 0.0


def test_beta_zero_ignores_ref() -> None:
    logp, old = logps_with_ratios(INSIDE_RATIOS)
    plain, _ = policy_loss(logp, old, INSIDE_ADV, INSIDE_MASK, settings("grpo"), INSIDE_NORM)
    (plain_grad,) = torch.autograd.grad(plain, logp)
    ref = old - 3.0  # far from logp: a large kl if it counted
    with_ref, stats = policy_loss(
        logp, old, INSIDE_ADV, INSIDE_MASK, settings("grpo"), INSIDE_NORM, ref_logp_B_T=ref
    )
    (ref_grad,) = torch.autograd.grad(with_ref, logp)
    assert with_ref.item() == plain.item() == approx(0.6)
    assert torch.equal(plain_grad, ref_grad)
    assert stats["kl_sum"].item() > 1.0  # still reported for monitoring


def test_beta_without_ref_raises() -> None:
    logp, old = logps_with_ratios(INSIDE_RATIOS)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, INSIDE_ADV, INSIDE_MASK, settings("grpo", beta=0.1), INSIDE_NORM)


# ----------------------------------------------------------------------------------------------
# Masking: wild values on a padded position change nothing, loss or gradient.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_padding_is_inert(loss_type: str) -> None:
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([0.7, -1.3])
    base_logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, -1.0]])
    old = torch.tensor([[-1.1, -0.4, -2.2], [-0.2, -1.0, -1.0]])
    ref = torch.tensor([[-0.9, -0.6, -1.8], [-0.4, -1.1, -1.0]])
    cfg = settings(loss_type, beta=0.05)

    def run(pad_logp: float, pad_old: float, pad_ref: float):
        logp = base_logp.clone()
        logp[1, 2] = pad_logp
        old_w, ref_w = old.clone(), ref.clone()
        old_w[1, 2], ref_w[1, 2] = pad_old, pad_ref
        logp.requires_grad_()
        loss, stats = policy_loss(logp, old_w, adv, mask, cfg, INSIDE_NORM, ref_logp_B_T=ref_w)
        loss.backward()
        return loss.detach(), logp.grad, stats

    clean_loss, clean_grad, clean_stats = run(-1.0, -1.0, -1.0)
    # exp(1e4 - (-1e4)) would overflow to inf without the guard.
    wild_loss, wild_grad, wild_stats = run(1e4, -1e4, -1e4)
    assert torch.isfinite(wild_loss)
    assert torch.equal(clean_loss, wild_loss)
    assert torch.equal(clean_grad, wild_grad)
    assert wild_grad[1, 2].item() == 0.0
    # A -inf logprob on padding (e.g. a masked-out vocabulary entry) must not turn into NaN either.
    inf_loss, inf_grad, _ = run(-math.inf, 0.0, 0.0)
    assert torch.equal(clean_loss, inf_loss)
    assert torch.equal(clean_grad, inf_grad)
    for key in clean_stats:
        assert torch.equal(clean_stats[key], wild_stats[key]), key


# ----------------------------------------------------------------------------------------------
# Micro-batches: halves with the whole-batch normaliser sum to the whole batch, loss and gradient.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_micro_batches_sum_to_batch(loss_type: str) -> None:
    gen = torch.Generator().manual_seed(0)
    B, T = 4, 5
    logp = (-torch.rand(B, T, generator=gen) * 2).double()
    old = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)  # some ratios clip
    ref = logp + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    norm = BatchNormalizer(num_sequences=B, num_tokens=int(mask.sum()), max_tokens=T)
    cfg = settings(loss_type, beta=0.04)

    whole_logp = logp.clone().requires_grad_()
    whole, whole_stats = policy_loss(whole_logp, old, adv, mask, cfg, norm, ref_logp_B_T=ref)
    whole.backward()

    split_logp = logp.clone().requires_grad_()
    total = torch.zeros(())
    halves = []
    for rows in (slice(0, 2), slice(2, 4)):
        part, stats = policy_loss(split_logp[rows], old[rows], adv[rows], mask[rows], cfg, norm, ref[rows])
        total = total + part
        halves.append(stats)
    total.backward()

    assert whole_stats["clipped_count"].item() > 0  # the test covers the clipped branch
    assert total.item() == approx(whole.item())
    assert torch.allclose(split_logp.grad, whole_logp.grad, rtol=1e-5, atol=1e-7)
    for key in ("token_count", "clipped_count", "ratio_sum", "ratio_sq_sum", "kl_sum", "seq_count"):
        assert (halves[0][key] + halves[1][key]).item() == approx(whole_stats[key].item()), key
    assert min(h["ratio_min"] for h in halves).item() == approx(whole_stats["ratio_min"].item())
    assert max(h["ratio_max"] for h in halves).item() == approx(whole_stats["ratio_max"].item())


# ----------------------------------------------------------------------------------------------
# token_logprobs
# ----------------------------------------------------------------------------------------------
def test_token_logprobs_hand_value() -> None:
    # logits [1, 2, 3] / T=2 -> [0.5, 1, 1.5]; token 2:
    # 1.5 - logsumexp = -log(1 + e^-0.5 + e^-1) = -log(1.9744101) = -0.6802697
    logits = torch.tensor([[[1.0, 2.0, 3.0]]])
    out = token_logprobs(logits, torch.tensor([[2]]), temperature=2.0)
    assert out.shape == (1, 1)
    assert out.item() == approx(-0.6802697)


def test_token_logprobs_matches_manual_log_softmax() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=gen)
    ids = torch.randint(0, 7, (2, 3), generator=gen)
    for temperature in (1.0, 0.7):
        manual = torch.log_softmax(logits / temperature, dim=-1)
        expected = torch.stack([torch.stack([manual[b, t, ids[b, t]] for t in range(3)]) for b in range(2)])
        assert torch.allclose(token_logprobs(logits, ids, temperature), expected, atol=1e-6)
    # Half-precision logits still give float32 logprobs.
    out = token_logprobs(logits.bfloat16(), ids)
    assert out.dtype == torch.float32
    with pytest.raises(ValueError):
        token_logprobs(logits, ids, temperature=0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_token_logprobs_gradient_equals_log_softmax_autograd(temperature: float, monkeypatch) -> None:
    """The selective path (no [B, T, V] log-softmax kept) has log_softmax's values and gradient, also when its
    rows go in several chunks (the chunk shrunk to 2 rows of 11 entries here), with padding-like repeats."""
    import learner.policy_loss as loss_module

    monkeypatch.setattr(loss_module, "_NUCLEUS_CHUNK_ENTRIES", 22)
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 5, 11, generator=gen, dtype=torch.float64) * 3).float()
    ids = torch.randint(0, 11, (3, 5), generator=gen)
    weights = torch.randn(3, 5, generator=gen)
    ours, reference = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = token_logprobs(ours, ids, temperature)
    want = torch.log_softmax(reference / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-6)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert torch.allclose(ours.grad, reference.grad, atol=1e-6)
    assert torch.autograd.gradcheck(lambda x: loss_module._SelectedLogprob.apply(x, ids, temperature),
                                    (logits.double().requires_grad_(),))


def test_settings_validation() -> None:
    with pytest.raises(ValueError):
        LossSettings(loss_type="ppo", clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError):
        LossSettings(loss_type="grpo", clip_low=1.0, clip_high=0.2)
    with pytest.raises(ValueError):
        BatchNormalizer(num_sequences=0, num_tokens=1, max_tokens=1)
