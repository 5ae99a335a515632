"""Class 8: hazards a report must name as the user wrote them: ``torch.from_numpy``,
``as_tensor``, ``new_tensor``, a mask assignment, a 0-d tensor index (an ``.item()``). Each
case lists in ``says`` the words a problem at its line must hold."""
from __future__ import annotations

import numpy as np
import torch

from . import helpers, nets
from . import sources as src
from .registry import DEVICE, case

# ---------------------------------------------------------------- torch.from_numpy


@case("from_numpy-env_obs", "message", "refused", src.H2D, family="from_numpy",
      variant="quoted", says=("from_numpy",))
def _from_numpy():
    obs_np = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    policy = helpers.mlp(4, 16, 2).to(DEVICE)

    def step(scale):
        obs = torch.from_numpy(obs_np).to(scale.device)  # HAZARD
        return policy(obs * scale)

    return step, (torch.ones(4, device=DEVICE),)


@case("from_numpy-copy_into_static", "message", "refused", src.H2D, family="from_numpy",
      variant="spelling", says=("from_numpy",))
def _from_numpy_copy():
    frame = np.zeros((4, 3), dtype=np.float32)
    static_obs = torch.zeros(4, 3, device=DEVICE)

    def step(w):
        static_obs.copy_(torch.from_numpy(frame))  # HAZARD
        return static_obs @ w

    return step, (torch.randn(3, 2, device=DEVICE),)


@case("from_numpy-env_bridge", "message", "refused", src.H2D, family="from_numpy",
      variant="method", hazard=nets.NumpyEnvBridge.observe, says=("from_numpy",))
def _from_numpy_method():
    bridge = nets.NumpyEnvBridge(4, DEVICE)
    return bridge.observe, (torch.full((4,), 2.0, device=DEVICE),)


@case("from_numpy-helper", "message", "refused", src.H2D, family="from_numpy",
      variant="helper", hazard=helpers.obs_from_numpy, says=("from_numpy",))
def _from_numpy_helper():
    arr = np.ones((8, 3), dtype=np.float32)

    def step(bias):
        return helpers.obs_from_numpy(arr, bias.device) + bias

    return step, (torch.zeros(3, device=DEVICE),)


# ---------------------------------------------------------------- torch.as_tensor


@case("as_tensor-python_rewards", "message", "refused", src.H2D, family="as_tensor",
      variant="quoted", says=("as_tensor",))
def _as_tensor():
    rewards = [0.0, 1.0, 0.5, 1.0]

    def step(values):
        r = torch.as_tensor(rewards, device=values.device)  # HAZARD
        return r + 0.99 * values

    return step, (torch.randn(4, device=DEVICE),)


@case("as_tensor-numpy_dtype", "message", "refused", src.H2D, family="as_tensor",
      variant="spelling", says=("as_tensor",))
def _as_tensor_np():
    mask_np = np.array([1, 0, 1, 1], dtype=np.float32)

    def step(logits):
        mask = torch.as_tensor(mask_np, dtype=logits.dtype, device=logits.device)  # HAZARD
        return logits + (mask - 1) * 1e9

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("as_tensor-reward_tracker", "message", "refused", src.H2D, family="as_tensor",
      variant="method", hazard=nets.RewardTracker.returns, says=("as_tensor",))
def _as_tensor_method():
    return nets.RewardTracker(DEVICE).returns, (torch.randn(4, device=DEVICE),)


@case("as_tensor-helper", "message", "refused", src.H2D, family="as_tensor",
      variant="helper", hazard=helpers.rewards_as_tensor, says=("as_tensor",))
def _as_tensor_helper():
    rewards = [1.0, 0.0, 0.0, 1.0]

    def step(values):
        return helpers.rewards_as_tensor(rewards, values.device) - values

    return step, (torch.randn(4, device=DEVICE),)


# ---------------------------------------------------------------- Tensor.new_tensor


@case("new_tensor-offsets", "message", "refused", src.H2D, family="new_tensor",
      variant="quoted", says=("new_tensor",))
def _new_tensor():
    def step(x):
        offsets = x.new_tensor([0.0, 1.0, 2.0])  # HAZARD
        return x + offsets

    return step, (torch.randn(8, 3, device=DEVICE),)


@case("new_tensor-from_numpy_array", "message", "refused", src.H2D, family="new_tensor",
      variant="spelling", says=("new_tensor",))
def _new_tensor_np():
    low = np.array([-1.0, -2.0], dtype=np.float32)

    def step(action):
        return torch.maximum(action, action.new_tensor(low))  # HAZARD

    return step, (torch.randn(8, 2, device=DEVICE),)


@case("new_tensor-feature_offsets", "message", "refused", src.H2D, family="new_tensor",
      variant="method", hazard=nets.FeatureOffsets.forward, says=("new_tensor",))
def _new_tensor_method():
    return nets.FeatureOffsets([0.1, 0.2, 0.3]), (torch.randn(8, 3, device=DEVICE),)


@case("new_tensor-helper", "message", "refused", src.H2D, family="new_tensor",
      variant="helper", hazard=helpers.bias_like, says=("new_tensor",))
def _new_tensor_helper():
    def step(x):
        return helpers.bias_like(x, [1.0, -1.0]).relu()

    return step, (torch.randn(8, 2, device=DEVICE),)


# ---------------------------------------------------------------- x[mask] = tensor_values


@case("mask_assign-values_by_mask", "message", "refused", src.MASK_ASSIGN,
      family="mask_assign_tensor", variant="quoted", says=("mask",))
def _mask_assign():
    def step(returns, bootstrap, done):
        returns = returns.clone()
        returns[done] = bootstrap[done]  # HAZARD
        return returns

    return step, (torch.randn(8, device=DEVICE), torch.randn(8, device=DEVICE),
                  torch.rand(8, device=DEVICE) < 0.3)


@case("mask_assign-device_scalar", "message", "refused", src.MASK_ASSIGN,
      family="mask_assign_tensor", variant="spelling", says=("mask",))
def _mask_assign_scalar():
    def step(adv, pad):
        adv = adv.clone()
        adv[pad] = adv.mean()  # HAZARD
        return adv

    return step, (torch.randn(8, device=DEVICE), torch.rand(8, device=DEVICE) < 0.3)


@case("mask_assign-index_put", "message", "refused", src.MASK_ASSIGN,
      family="mask_assign_tensor", variant="spelling", says=("mask",))
def _mask_assign_index_put():
    def step(x, mask, fill):
        return x.index_put((mask,), fill)  # HAZARD

    return step, (torch.randn(8, device=DEVICE), torch.rand(8, device=DEVICE) < 0.5,
                  torch.zeros(1, device=DEVICE))


@case("mask_assign-mean_filler", "message", "refused", src.MASK_ASSIGN,
      family="mask_assign_tensor", variant="method", hazard=nets.MeanFiller.forward,
      says=("mask",))
def _mask_assign_method():
    return nets.MeanFiller(), (torch.randn(6, 3, device=DEVICE),
                               torch.rand(6, 3, device=DEVICE) < 0.2)


@case("mask_assign-helper_fill", "message", "refused", src.MASK_ASSIGN,
      family="mask_assign_tensor", variant="helper", hazard=helpers.fill_masked,
      says=("mask",))
def _mask_assign_helper():
    def step(x, missing):
        return helpers.fill_masked(x, missing).sum(-1)

    return step, (torch.randn(6, 3, device=DEVICE), torch.rand(6, 3, device=DEVICE) < 0.2)


# ---------------------------------------------------------------- a 0-d tensor index


@case("zero_d_index-getitem", "message", "refused", src.INT_INDEX,
      family="zero_d_index", variant="quoted", says=("item",))
def _zero_d():
    def step(buf, t):
        return buf[t] * 2  # HAZARD

    return step, (torch.randn(5, 3, device=DEVICE), torch.tensor(2, device=DEVICE))


@case("zero_d_index-setitem", "message", "refused", src.INT_INDEX,
      family="zero_d_index", variant="spelling", says=("item",))
def _zero_d_set():
    buf = torch.zeros(6, 2, device=DEVICE)
    ptr = torch.zeros((), dtype=torch.long, device=DEVICE)

    def step(x):
        buf[ptr] = x  # HAZARD
        ptr.add_(1).remainder_(buf.shape[0])
        return buf.sum(0)

    return step, (torch.randn(2, device=DEVICE),)


@case("zero_d_index-slice_bounds", "message", "refused",
      src.INT_INDEX + f"; {src.NV_CHECKLIST}: no slicing with CUDA tensor bounds",
      family="zero_d_index", variant="spelling", says=("item",))
def _zero_d_slice():
    def step(seq, start):
        return seq[start:start + 4].mean(0)  # HAZARD

    return step, (torch.randn(10, 3, device=DEVICE), torch.tensor(3, device=DEVICE))


@case("zero_d_index-rollout_storage", "message", "refused", src.INT_INDEX,
      family="zero_d_index", variant="method", hazard=nets.RolloutStorage.insert,
      says=("item",))
def _zero_d_method():
    storage = nets.RolloutStorage(4, 3, DEVICE)

    def step(obs):
        storage.insert(obs)
        return storage.obs.mean(0)

    return step, (torch.randn(3, device=DEVICE),)


@case("zero_d_index-helper_gather_row", "message", "refused", src.INT_INDEX,
      family="zero_d_index", variant="helper", hazard=helpers.gather_row, says=("item",))
def _zero_d_helper():
    def step(table, index):
        return helpers.gather_row(table, index).softmax(-1)

    return step, (torch.randn(5, 4, device=DEVICE), torch.tensor(1, device=DEVICE))
