"""Class 1: host reads inside ATen kernels (linalg error checks, histc's default range, ops of
data-dependent size), the distributions' argument validation, and the sampling ops that stay
on the device (multinomial, an unvalidated Categorical)."""
from __future__ import annotations

import torch
from torch.distributions import Categorical, MultivariateNormal, Normal

from . import helpers, nets
from . import sources as src
from .registry import DEVICE, case

MVN = ("torch/distributions/multivariate_normal.py:194 MultivariateNormal(covariance_matrix=) "
       "computes torch.linalg.cholesky(covariance_matrix) in __init__; ")

# ---------------------------------------------------------------- torch.linalg.inv


@case("linalg_inv-natural_gradient", "kernel_sync", "refused", src.linalg("linalg_inv_out"),
      family="linalg_inv", variant="quoted")
def _inv_natural_gradient():
    def step(fisher, grad):
        damped = fisher + 1e-3 * torch.eye(fisher.shape[-1], device=fisher.device)
        precond = torch.linalg.inv(damped)  # HAZARD
        return precond @ grad

    return step, (helpers.spd(6, DEVICE), torch.randn(6, device=DEVICE))


@case("linalg_inv-torch_inverse_whitening", "kernel_sync", "refused",
      src.linalg("linalg_inv_out (torch.inverse is its alias)"), family="linalg_inv",
      variant="spelling")
def _inv_whitening():
    def step(obs, cov):
        whiten = torch.inverse(cov)  # HAZARD
        return (obs - obs.mean(0)) @ whiten

    return step, (torch.randn(32, 5, device=DEVICE), helpers.spd(5, DEVICE))


@case("linalg_inv-tensor_method_linucb", "kernel_sync", "refused",
      src.linalg("linalg_inv_out (Tensor.inverse)"), family="linalg_inv", variant="spelling")
def _inv_linucb():
    def step(phi, design):
        a_inv = design.inverse()  # HAZARD
        bonus = ((phi @ a_inv) * phi).sum(-1).sqrt()
        return phi.sum(-1) + 0.5 * bonus

    return step, (torch.randn(16, 4, device=DEVICE), helpers.spd(4, DEVICE))


@case("linalg_inv-kalman_filter", "kernel_sync", "refused", src.linalg("linalg_inv_out"),
      family="linalg_inv", variant="method", hazard=nets.KalmanFilter.update)
def _inv_kalman():
    kf = nets.KalmanFilter(4, 2).to(DEVICE)
    return kf.update, (torch.randn(2, device=DEVICE),)


@case("linalg_inv-helper_mahalanobis", "kernel_sync", "refused", src.linalg("linalg_inv_out"),
      family="linalg_inv", variant="helper", hazard=helpers.mahalanobis)
def _inv_helper():
    def step(obs, mean, cov):
        score = helpers.mahalanobis(obs, mean, cov)
        return score.clamp(max=10.0)

    return step, (torch.randn(8, 3, device=DEVICE), torch.zeros(3, device=DEVICE),
                  helpers.spd(3, DEVICE))


# ---------------------------------------------------------------- torch.linalg.solve


@case("linalg_solve-lstd", "kernel_sync", "refused", src.linalg("linalg_solve_out"),
      family="linalg_solve", variant="quoted")
def _solve_lstd():
    def step(phi, phi_next, reward):
        a_mat = phi.mT @ (phi - 0.99 * phi_next) + 1e-2 * torch.eye(phi.shape[1],
                                                                     device=phi.device)
        w = torch.linalg.solve(a_mat, phi.mT @ reward)  # HAZARD
        return phi @ w

    return step, (torch.randn(64, 6, device=DEVICE), torch.randn(64, 6, device=DEVICE),
                  torch.randn(64, device=DEVICE))


@case("linalg_solve-right_batched", "kernel_sync", "refused",
      src.linalg("linalg_solve_out (left=False, batched: is_matrix false, same check)"),
      family="linalg_solve", variant="spelling")
def _solve_right():
    def step(a, b):
        x = torch.linalg.solve(a, b, left=False)  # HAZARD
        return x.square().mean()

    return step, (helpers.spd(3, DEVICE, batch=(4,)), torch.randn(4, 2, 3, device=DEVICE))


@case("linalg_solve-gp_critic", "kernel_sync", "refused", src.linalg("linalg_solve_out"),
      family="linalg_solve", variant="method", hazard=nets.GPCritic.forward)
def _solve_gp():
    critic = nets.GPCritic(torch.randn(10, 3), torch.randn(10)).to(DEVICE)
    return critic, (torch.randn(5, 3, device=DEVICE),)


@case("linalg_solve-helper_ridge", "kernel_sync", "refused", src.linalg("linalg_solve_out"),
      family="linalg_solve", variant="helper", hazard=helpers.ridge_weights)
def _solve_helper():
    def step(feats, returns):
        w = helpers.ridge_weights(feats, returns, 1e-2)
        return feats @ w

    return step, (torch.randn(32, 5, device=DEVICE), torch.randn(32, device=DEVICE))


# ---------------------------------------------------------------- torch.linalg.cholesky


@case("linalg_cholesky-correlated_exploration", "kernel_sync", "refused",
      src.linalg("linalg_cholesky_out"), family="linalg_cholesky", variant="quoted")
def _chol_quoted():
    def step(mean, cov):
        chol = torch.linalg.cholesky(cov)  # HAZARD
        eps = torch.randn(16, mean.shape[0], device=mean.device)
        return mean + eps @ chol.mT

    return step, (torch.zeros(4, device=DEVICE), helpers.spd(4, DEVICE))


@case("linalg_cholesky-deprecated_torch_cholesky", "kernel_sync", "refused",
      src.linalg("cholesky (the deprecated torch.cholesky)"), family="linalg_cholesky",
      variant="spelling")
def _chol_deprecated():
    def step(cov, z):
        chol = torch.cholesky(cov)  # HAZARD
        return z @ chol.mT

    return step, (helpers.spd(3, DEVICE), torch.randn(8, 3, device=DEVICE))


@case("linalg_cholesky-mvn_covariance", "kernel_sync", "refused",
      MVN + src.linalg("linalg_cholesky_out"), family="linalg_cholesky", variant="spelling")
def _chol_mvn():
    def step(mu, cov):
        dist = MultivariateNormal(mu, covariance_matrix=cov, validate_args=False)  # HAZARD
        action = dist.rsample()
        return action, dist.log_prob(action)

    return step, (torch.randn(8, 3, device=DEVICE), helpers.spd(3, DEVICE))


@case("linalg_cholesky-full_cov_policy", "kernel_sync", "refused",
      src.linalg("linalg_cholesky_out"), family="linalg_cholesky", variant="method",
      hazard=nets.FullCovPolicy.forward)
def _chol_method():
    policy = nets.FullCovPolicy(6, 3).to(DEVICE)
    return policy, (torch.randn(8, 6, device=DEVICE),)


@case("linalg_cholesky-helper_noise", "kernel_sync", "refused",
      src.linalg("linalg_cholesky_out"), family="linalg_cholesky", variant="helper",
      hazard=helpers.correlated_noise)
def _chol_helper():
    def step(action, cov):
        return (action + 0.1 * helpers.correlated_noise(cov, action.shape[0])).clamp(-1, 1)

    return step, (torch.zeros(16, 2, device=DEVICE), helpers.spd(2, DEVICE))


@case("cholesky_ex-no_error_check", "kernel_sync", "capturable",
      "aten/src/ATen/native/BatchLinearAlgebra.cpp linalg_cholesky_ex: check_errors=False "
      "(the default) never calls _linalg_check_errors; the info tensor stays on the device "
      "(cuSOLVER potrf writes it there)",
      unsure="cuSOLVER's potrf is assumed capture-safe (workspace from the caching allocator, "
             "info written on the device); no torch test captures it")
def _chol_ex():
    def step(mean, cov):
        chol, info = torch.linalg.cholesky_ex(cov)
        eps = torch.randn(16, mean.shape[0], device=mean.device)
        return mean + eps @ chol.mT, info

    return step, (torch.zeros(4, device=DEVICE), helpers.spd(4, DEVICE))


@case("mvn-scale_tril", "kernel_sync", "capturable",
      "torch/distributions/multivariate_normal.py: with scale_tril= no cholesky is computed; "
      "rsample draws standard normals from the default generator; validate_args=False skips "
      "the checks. " + src.RNG_OK)
def _mvn_tril():
    def step(mu, tril):
        dist = MultivariateNormal(mu, scale_tril=tril, validate_args=False)
        action = dist.rsample()
        return action, dist.log_prob(action)

    return step, (torch.randn(8, 3, device=DEVICE),
                  torch.linalg.cholesky(helpers.spd(3, DEVICE)))


# ---------------------------------------------------------------- torch.histc


@case("histc-advantage_histogram", "kernel_sync", "refused", src.HISTC,
      family="histc_default_range", variant="quoted")
def _histc_quoted():
    def step(adv):
        hist = torch.histc(adv, bins=20)  # HAZARD
        return hist / adv.numel()

    return step, (torch.randn(256, device=DEVICE),)


@case("histc-method_call", "kernel_sync", "refused", src.HISTC,
      family="histc_default_range", variant="spelling")
def _histc_method_call():
    def step(returns):
        return returns.histc(bins=16)  # HAZARD

    return step, (torch.randn(128, device=DEVICE),)


@case("histc-explicit_zero_range", "kernel_sync", "refused", src.HISTC,
      family="histc_default_range", variant="spelling")
def _histc_zero_range():
    def step(x):
        lo, hi = 0, 0
        return torch.histc(x, bins=10, min=lo, max=hi)  # HAZARD

    return step, (torch.rand(100, device=DEVICE),)


@case("histc-action_histogram_module", "kernel_sync", "refused", src.HISTC,
      family="histc_default_range", variant="method", hazard=nets.ActionHistogram.forward)
def _histc_method():
    logger = nets.ActionHistogram(bins=6)
    return logger, (torch.randint(0, 6, (64,), device=DEVICE),)


@case("histc-helper_value_histogram", "kernel_sync", "refused", src.HISTC,
      family="histc_default_range", variant="helper", hazard=helpers.value_histogram)
def _histc_helper():
    critic = torch.nn.Linear(4, 1).to(DEVICE)

    def step(obs):
        v = critic(obs).squeeze(-1)
        return v.detach(), helpers.value_histogram(v.detach())

    return step, (torch.randn(64, 4, device=DEVICE),)


@case("histc-fixed_range", "kernel_sync", "capturable", src.HISTC_RANGE)
def _histc_range():
    def step(adv):
        return torch.histc(adv, bins=20, min=-5.0, max=5.0) / adv.numel()

    return step, (torch.randn(256, device=DEVICE),)


@case("histc-helper_fixed_range", "kernel_sync", "capturable", src.HISTC_RANGE)
def _histc_range_helper():
    def step(v):
        return helpers.bounded_histogram(v, -10.0, 10.0)

    return step, (torch.randn(256, device=DEVICE),)


# ---------------------------------------------------------------- ops of data-dependent size


@case("bincount-action_counts", "kernel_sync", "refused", src.BINCOUNT)
def _bincount():
    def step(actions):
        counts = torch.bincount(actions, minlength=6)  # HAZARD
        return counts.float() / actions.numel()

    return step, (torch.randint(0, 6, (64,), device=DEVICE),)


@case("bincount-weighted_rewards", "kernel_sync", "refused", src.BINCOUNT)
def _bincount_weighted():
    def step(actions, rewards):
        return actions.bincount(weights=rewards, minlength=4)  # HAZARD

    return step, (torch.randint(0, 4, (32,), device=DEVICE), torch.rand(32, device=DEVICE))


@case("nonzero-done_indices", "kernel_sync", "refused", src.NONZERO)
def _nonzero():
    def step(dones, values):
        idx = torch.nonzero(dones).squeeze(-1)  # HAZARD
        return values.index_select(0, idx).sum()

    return step, (torch.tensor([0, 1, 0, 1], device=DEVICE), torch.randn(4, device=DEVICE))


@case("bool_mask-terminal_values", "kernel_sync", "refused", src.MASK_INDEX)
def _bool_mask():
    def step(values, dones):
        terminal = values[dones.bool()]  # HAZARD
        return terminal.mean()

    return step, (torch.randn(8, device=DEVICE), (torch.arange(8, device=DEVICE) % 3 == 0))


@case("unique-visited_states", "kernel_sync", "refused", src.NONZERO.replace(
    "Nonzero.cu nonzero_out_cuda copies the number of nonzero elements",
    "Unique.cu unique_cuda copies the number of unique elements"))
def _unique():
    def step(states):
        visited = torch.unique(states)  # HAZARD
        return visited.float().mean()

    return step, (torch.randint(0, 10, (32,), device=DEVICE),)


@case("masked_select-positive_td", "kernel_sync", "refused", src.NONZERO.replace(
    "Nonzero.cu nonzero_out_cuda copies the number of nonzero elements",
    "masked_select (IndexingUtils.h expandTensors, nonzero) reads the number of selected "
    "elements"))
def _masked_select():
    def step(td):
        pos = torch.masked_select(td, td > 0)  # HAZARD
        return pos.sum()

    return step, (torch.randn(16, device=DEVICE),)


# ---------------------------------------------------------------- torch.multinomial


@case("multinomial-one_sample", "kernel_sync", "capturable", src.MULTINOMIAL,
      family="multinomial", variant="quoted")
def _multinomial():
    def step(logits):
        probs = torch.softmax(logits, -1)
        return torch.multinomial(probs, 1).squeeze(-1)

    return step, (torch.randn(16, 4, device=DEVICE),)


@case("multinomial-tensor_method_two_samples", "kernel_sync", "capturable", src.MULTINOMIAL,
      family="multinomial", variant="spelling")
def _multinomial_topk():
    def step(scores):
        probs = scores.softmax(-1)
        return probs.multinomial(num_samples=2)

    return step, (torch.randn(8, 6, device=DEVICE),)


@case("multinomial-policy_module", "kernel_sync", "capturable", src.MULTINOMIAL,
      family="multinomial", variant="method")
def _multinomial_method():
    policy = nets.SoftmaxPolicy(5, 3).to(DEVICE)
    return policy.act, (torch.randn(16, 5, device=DEVICE),)


@case("multinomial-helper", "kernel_sync", "capturable", src.MULTINOMIAL,
      family="multinomial", variant="helper")
def _multinomial_helper():
    def step(q):
        return helpers.sample_from_probs(torch.softmax(q / 0.5, -1))

    return step, (torch.randn(16, 4, device=DEVICE),)


# ---------------------------------------------------------------- torch.distributions


@case("categorical-no_validation_logits", "kernel_sync", "capturable", src.CATEGORICAL,
      family="categorical_unvalidated", variant="quoted")
def _cat_logits():
    def step(logits):
        return Categorical(logits=logits, validate_args=False).sample()

    return step, (torch.randn(16, 4, device=DEVICE),)


@case("categorical-no_validation_probs", "kernel_sync", "capturable", src.CATEGORICAL,
      family="categorical_unvalidated", variant="spelling")
def _cat_probs():
    def step(probs):
        dist = Categorical(probs=probs, validate_args=False)
        action = dist.sample()
        return action, dist.log_prob(action), dist.entropy()

    return step, (torch.softmax(torch.randn(16, 4, device=DEVICE), -1),)


@case("categorical-cleanrl_actor_critic", "kernel_sync", "capturable", src.CATEGORICAL,
      family="categorical_unvalidated", variant="method")
def _cat_method():
    agent = nets.ActorCritic(8, 4).to(DEVICE)
    return agent.get_action_and_value, (torch.randn(16, 8, device=DEVICE),)


@case("categorical-helper_sample", "kernel_sync", "capturable", src.CATEGORICAL,
      family="categorical_unvalidated", variant="helper")
def _cat_helper():
    def step(logits):
        action, logp = helpers.categorical_sample(logits)
        return action, logp

    return step, (torch.randn(16, 4, device=DEVICE),)


@case("categorical-validated_default", "kernel_sync", "refused", src.VALIDATION,
      family="categorical_validated", variant="quoted")
def _cat_validated():
    def step(logits):
        action = Categorical(logits=logits).sample()  # HAZARD
        return action

    return step, (torch.randn(16, 4, device=DEVICE),)


@case("normal-validated_default", "kernel_sync", "refused", src.VALIDATION,
      family="categorical_validated", variant="spelling")
def _normal_validated():
    def step(mu, log_std):
        dist = Normal(mu, log_std.exp())  # HAZARD
        action = dist.rsample()
        return action, dist.log_prob(action).sum(-1)

    return step, (torch.randn(8, 2, device=DEVICE), torch.zeros(8, 2, device=DEVICE))


@case("categorical-validated_module", "kernel_sync", "refused", src.VALIDATION,
      family="categorical_validated", variant="method", hazard=nets.ValidatedPolicy.forward)
def _cat_validated_method():
    policy = nets.ValidatedPolicy(6, 3).to(DEVICE)
    return policy, (torch.randn(16, 6, device=DEVICE),)


@case("categorical-validated_helper", "kernel_sync", "refused", src.VALIDATION,
      family="categorical_validated", variant="helper", hazard=helpers.policy_entropy)
def _cat_validated_helper():
    def step(logits):
        return -0.01 * helpers.policy_entropy(logits)

    return step, (torch.randn(16, 4, device=DEVICE),)


@case("normal-unvalidated_sac_tanh", "kernel_sync", "capturable",
      "Normal(validate_args=False) skips distribution.py:56-76; rsample is loc + scale * "
      "randn from the default generator. " + src.RNG_OK)
def _normal_sac():
    def step(mu, log_std):
        dist = Normal(mu, log_std.clamp(-5, 2).exp(), validate_args=False)
        u = dist.rsample()
        action = torch.tanh(u)
        logp = dist.log_prob(u).sum(-1) - torch.log1p(-action.square() + 1e-6).sum(-1)
        return action, logp

    return step, (torch.randn(8, 2, device=DEVICE), torch.zeros(8, 2, device=DEVICE))
