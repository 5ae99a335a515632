"""Class 6: clean code the rehearsal must not flag, each quoted example with its hazardous twin
(which must stay flagged), and ordinary clean RL steps."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributions import Categorical

from . import helpers, nets
from . import sources as src
from .registry import DEVICE, case

#: The portable device idiom, as user code writes it at module level.
device = "cuda" if torch.cuda.is_available() else "cpu"

# ---------------------------------------------------------------- one_hot


@case("one_hot-num_classes", "clean", "capturable", src.ONE_HOT,
      family="one_hot_num_classes", variant="quoted")
def _one_hot():
    def step(a):
        return F.one_hot(a, num_classes=5).float()

    return step, (torch.randint(0, 5, (16,), device=DEVICE),)


@case("one_hot-positional_dqn_q_of_a", "clean", "capturable", src.ONE_HOT,
      family="one_hot_num_classes", variant="spelling")
def _one_hot_dqn():
    qnet = helpers.mlp(6, 32, 4).to(DEVICE)

    def step(obs, act, target):
        q_a = (qnet(obs) * F.one_hot(act, 4)).sum(-1)
        return F.smooth_l1_loss(q_a, target)

    return step, (torch.randn(16, 6, device=DEVICE), torch.randint(0, 4, (16,), device=DEVICE),
                  torch.randn(16, device=DEVICE))


@case("one_hot-discrete_critic", "clean", "capturable", src.ONE_HOT,
      family="one_hot_num_classes", variant="method")
def _one_hot_method():
    critic = nets.DiscreteCritic(6, 4).to(DEVICE)
    return critic.q_of, (torch.randn(16, 6, device=DEVICE),
                         torch.randint(0, 4, (16,), device=DEVICE))


@case("one_hot-helper_q_of_action", "clean", "capturable", src.ONE_HOT,
      family="one_hot_num_classes", variant="helper")
def _one_hot_helper():
    def step(q, act):
        return helpers.q_of_action(q, act, q.shape[-1])

    return step, (torch.randn(16, 4, device=DEVICE), torch.randint(0, 4, (16,), device=DEVICE))


@case("one_hot-inferred", "clean", "refused", src.ONE_HOT_INFERRED,
      family="one_hot_inferred", variant="quoted")
def _one_hot_inferred():
    def step(a):
        return F.one_hot(a).float()  # HAZARD

    return step, (torch.randint(0, 5, (16,), device=DEVICE),)


@case("one_hot-minus_one", "clean", "refused", src.ONE_HOT_INFERRED,
      family="one_hot_inferred", variant="spelling")
def _one_hot_minus_one():
    def step(a, q):
        mask = torch.nn.functional.one_hot(a, -1)  # HAZARD
        return (q[:, : mask.shape[1]] * mask).sum(-1)

    return step, (torch.randint(0, 4, (16,), device=DEVICE), torch.randn(16, 4, device=DEVICE))


@case("one_hot-inferred_module", "clean", "refused", src.ONE_HOT_INFERRED,
      family="one_hot_inferred", variant="method", hazard=nets.InferredOneHot.q_of)
def _one_hot_inferred_method():
    critic = nets.InferredOneHot(6, 4).to(DEVICE)
    return critic.q_of, (torch.randn(16, 6, device=DEVICE),
                         torch.tensor([3] + [0, 1, 2] * 5, device=DEVICE))


@case("one_hot-inferred_helper", "clean", "refused", src.ONE_HOT_INFERRED,
      family="one_hot_inferred", variant="helper", hazard=helpers.one_hot_auto)
def _one_hot_inferred_helper():
    def step(a):
        return helpers.one_hot_auto(a).mean(0)

    return step, (torch.randint(0, 5, (16,), device=DEVICE),)


# ---------------------------------------------------------------- a boolean mask, a scalar


@case("mask_fill-quoted_relu_by_mask", "clean", "capturable", src.MASKED_FILL,
      family="mask_fill_scalar", variant="quoted")
def _mask_fill():
    def step(x):
        y = x * 2
        y[y < 0] = 0.0
        return y

    return step, (torch.randn(16, device=DEVICE),)


@case("mask_fill-zero_terminal_advantages", "clean", "capturable", src.MASKED_FILL,
      family="mask_fill_scalar", variant="spelling")
def _mask_fill_int():
    def step(adv, dones):
        adv = adv.clone()
        adv[dones.bool()] = 0
        return adv

    return step, (torch.randn(16, device=DEVICE), (torch.rand(16, device=DEVICE) < 0.2).float())


@case("mask_fill-action_masker", "clean", "capturable", src.MASKED_FILL,
      family="mask_fill_scalar", variant="method")
def _mask_fill_method():
    valid = torch.rand(8, 5, device=DEVICE) < 0.7
    valid[:, 0] = True
    return nets.ActionMasker(), (torch.randn(8, 5, device=DEVICE), valid)


@case("mask_fill-helper_zero_negatives", "clean", "capturable", src.MASKED_FILL,
      family="mask_fill_scalar", variant="helper")
def _mask_fill_helper():
    def step(td):
        return helpers.zero_negatives(td).mean()

    return step, (torch.randn(16, device=DEVICE),)


@case("mask_fill-masked_fill_method", "clean", "capturable",
      "Tensor.masked_fill with a Python scalar: one elementwise kernel. " + src.CLEAN)
def _masked_fill():
    def step(logits, valid):
        return logits.masked_fill(~valid, float("-inf")).softmax(-1)

    valid = torch.ones(8, 5, dtype=torch.bool, device=DEVICE)
    valid[:, 3] = False
    return step, (torch.randn(8, 5, device=DEVICE), valid)


@case("where-terminal_bootstrap", "clean", "capturable",
      "torch.where with a device mask: one elementwise kernel. " + src.CLEAN)
def _where():
    def step(v_next, done, r):
        return r + 0.99 * torch.where(done, 0.0, v_next)

    return step, (torch.randn(16, device=DEVICE), torch.rand(16, device=DEVICE) < 0.1,
                  torch.randn(16, device=DEVICE))


# ---------------------------------------------------------------- a 0-d CPU scalar tensor


@case("cpu_scalar-quoted_half", "clean", "capturable", src.CPU_SCALAR,
      family="cpu_scalar_tensor", variant="quoted")
def _cpu_scalar():
    def step(x):
        return x * torch.tensor(0.5)

    return step, (torch.randn(8, device=DEVICE),)


@case("cpu_scalar-as_tensor_gamma", "clean", "capturable", src.CPU_SCALAR,
      family="cpu_scalar_tensor", variant="spelling")
def _cpu_scalar_as_tensor():
    def step(r, v_next):
        gamma = torch.as_tensor(0.99)
        return r + gamma * v_next

    return step, (torch.randn(8, device=DEVICE), torch.randn(8, device=DEVICE))


@case("cpu_scalar-td_target_module", "clean", "capturable", src.CPU_SCALAR,
      family="cpu_scalar_tensor", variant="method")
def _cpu_scalar_method():
    return nets.TDTarget(0.99), (torch.randn(8, device=DEVICE),
                                 (torch.rand(8, device=DEVICE) < 0.1).float(),
                                 torch.randn(8, device=DEVICE))


@case("cpu_scalar-helper_discount", "clean", "capturable", src.CPU_SCALAR,
      family="cpu_scalar_tensor", variant="helper")
def _cpu_scalar_helper():
    def step(values):
        return helpers.discount(values, 0.97)

    return step, (torch.randn(8, device=DEVICE),)


@case("host_tensor-vector_mixed", "clean", "refused",
      "a 1-d tensor made without device= is a host tensor that a CUDA op refuses to mix "
      "('Expected all tensors to be on the same device', "
      "aten/src/ATen/TensorIterator.cpp compute_types: only 0-d CPU scalars are allowed)")
def _host_vector():
    def step(x):
        return x * torch.tensor([1.0, 0.5, 0.25, 0.125])  # HAZARD

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("host_tensor-helper_scale_by", "clean", "refused",
      "a 1-d host tensor mixed into a CUDA op (aten/src/ATen/TensorIterator.cpp "
      "compute_types: only 0-d CPU scalars are allowed)",
      hazard=helpers.scale_by)
def _host_vector_helper():
    def step(x):
        return helpers.scale_by(x, [1.0, 2.0, 3.0])

    return step, (torch.randn(8, 3, device=DEVICE),)


@case("host_tensor-built_on_device", "clean", "refused", src.H2D)
def _tensor_on_device():
    def step(x):
        weights = torch.tensor([0.5, 0.3, 0.2], device=x.device)  # HAZARD
        return x @ weights

    return step, (torch.randn(8, 3, device=DEVICE),)


# ---------------------------------------------------------------- repeat_interleave


@case("repeat_interleave-output_size", "clean", "capturable", src.REPEAT,
      family="repeat_interleave_output_size", variant="quoted")
def _ri():
    def step(x, reps):
        return x.repeat_interleave(reps, dim=0, output_size=8)

    return step, (torch.randn(4, 3, device=DEVICE), torch.tensor([2, 2, 2, 2], device=DEVICE))


@case("repeat_interleave-counts_only", "clean", "capturable", src.REPEAT,
      family="repeat_interleave_output_size", variant="spelling")
def _ri_counts():
    def step(lengths, values):
        episode_of_step = torch.repeat_interleave(lengths, output_size=12)
        return values.index_select(0, episode_of_step)

    return step, (torch.tensor([4, 3, 5], device=DEVICE), torch.randn(3, device=DEVICE))


@case("repeat_interleave-segment_expander", "clean", "capturable", src.REPEAT,
      family="repeat_interleave_output_size", variant="method")
def _ri_method():
    return nets.SegmentExpander(10), (torch.randn(3, 2, device=DEVICE),
                                      torch.tensor([2, 3, 5], device=DEVICE))


@case("repeat_interleave-helper", "clean", "capturable", src.REPEAT,
      family="repeat_interleave_output_size", variant="helper")
def _ri_helper():
    def step(x, counts):
        return helpers.expand_by_counts(x, counts, 6).sum(0)

    return step, (torch.randn(3, 4, device=DEVICE), torch.tensor([1, 2, 3], device=DEVICE))


@case("repeat_interleave-int_repeats", "clean", "capturable",
      "aten/src/ATen/native/Repeat.cpp repeat_interleave_symint with an int repeat computes "
      "the output size on the host from the shape (pytorch/pytorch#60965), no device read")
def _ri_int():
    def step(obs):
        return obs.repeat_interleave(4, dim=0)

    return step, (torch.randn(8, 3, device=DEVICE),)


@case("repeat_interleave-inferred", "clean", "refused", src.REPEAT_INFERRED,
      family="repeat_interleave_inferred", variant="quoted")
def _ri_inferred():
    def step(x, reps):
        return x.repeat_interleave(reps, dim=0)  # HAZARD

    return step, (torch.randn(4, 3, device=DEVICE), torch.tensor([2, 2, 2, 2], device=DEVICE))


@case("repeat_interleave-counts_only_inferred", "clean", "refused", src.REPEAT_INFERRED,
      family="repeat_interleave_inferred", variant="spelling")
def _ri_counts_inferred():
    def step(lengths, values):
        episode_of_step = torch.repeat_interleave(lengths)  # HAZARD
        return values.index_select(0, episode_of_step)

    return step, (torch.tensor([4, 3, 5], device=DEVICE), torch.randn(3, device=DEVICE))


@case("repeat_interleave-dynamic_expander", "clean", "refused", src.REPEAT_INFERRED,
      family="repeat_interleave_inferred", variant="method",
      hazard=nets.DynamicExpander.forward)
def _ri_inferred_method():
    return nets.DynamicExpander(), (torch.randn(3, 2, device=DEVICE),
                                    torch.tensor([2, 3, 5], device=DEVICE))


@case("repeat_interleave-helper_inferred", "clean", "refused", src.REPEAT_INFERRED,
      family="repeat_interleave_inferred", variant="helper",
      hazard=helpers.expand_by_counts_dynamic)
def _ri_inferred_helper():
    def step(x, counts):
        return helpers.expand_by_counts_dynamic(x, counts).sum(0)

    return step, (torch.randn(3, 4, device=DEVICE), torch.tensor([1, 2, 3], device=DEVICE))


# ---------------------------------------------------------------- .to(device), .to("cpu")


@case("to_device-portable_idiom", "clean", "capturable", src.TO_DEVICE,
      family="portable_to_device", variant="quoted")
def _to_device():
    net = helpers.mlp(4, 16, 2).to(device)

    def step(obs):
        return net(obs.to(device))

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("to_device-torch_device_non_blocking", "clean", "capturable", src.TO_DEVICE,
      family="portable_to_device", variant="spelling")
def _to_device_obj():
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def step(obs, reward):
        obs = obs.to(dev, non_blocking=True)
        reward = reward.to(device=dev, dtype=torch.float32)
        return obs.sum(-1) + reward

    return step, (torch.randn(8, 4, device=DEVICE), torch.randn(8, device=DEVICE))


@case("to_device-portable_policy", "clean", "capturable", src.TO_DEVICE,
      family="portable_to_device", variant="method")
def _to_device_method():
    policy = nets.PortablePolicy(4, 2)
    policy.to(policy.device)
    return policy, (torch.randn(8, 4, device=DEVICE),)


@case("to_device-helper_batch", "clean", "capturable", src.TO_DEVICE,
      family="portable_to_device", variant="helper")
def _to_device_helper():
    def step(obs, act):
        batch = helpers.to_device({"obs": obs, "act": act}, device)
        return batch["obs"].sum(-1) * batch["act"]

    return step, (torch.randn(8, 4, device=DEVICE), torch.randn(8, device=DEVICE))


# ---------------------------------------------------------------- a read a capture skips


@case("log_unless_capturing-loss_history", "clean", "capturable", src.CAPTURE_FLAG_READ,
      family="log_unless_capturing", variant="quoted")
def _log_guard():
    net = helpers.mlp(4, 16, 1).to(DEVICE)
    history: list[float] = []

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        if not torch.cuda.is_current_stream_capturing():
            history.append(loss.item())
        return loss.detach()

    return step, (torch.randn(16, 4, device=DEVICE), torch.randn(16, 1, device=DEVICE))


@case("log_unless_capturing-flag_and_print", "clean", "capturable", src.CAPTURE_FLAG_READ,
      family="log_unless_capturing", variant="spelling")
def _log_guard_flag():
    def step(obs, act):
        logits = obs @ torch.ones(4, 3, device=obs.device)
        entropy = Categorical(logits=logits, validate_args=False).entropy()
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing:
            print(f"entropy {float(entropy.mean()):.3f}, max {entropy.max().item():.3f}",
                  end="\r")
        return entropy, logits.gather(-1, act[:, None])

    return step, (torch.randn(8, 4, device=DEVICE), torch.randint(0, 3, (8,), device=DEVICE))


@case("log_unless_capturing-critic_progress", "clean", "capturable", src.CAPTURE_FLAG_READ,
      family="log_unless_capturing", variant="method")
def _log_guard_method():
    return nets.LoggingCritic(4).to(DEVICE), (torch.randn(8, 4, device=DEVICE),)


@case("log_unless_capturing-helper_log", "clean", "capturable", src.CAPTURE_FLAG_READ,
      family="log_unless_capturing", variant="helper")
def _log_guard_helper():
    log: list = []

    def step(q, target):
        td = target - q
        helpers.log_unless_capturing(log, "td", td.abs())
        return td.square().mean()

    return step, (torch.randn(16, device=DEVICE), torch.randn(16, device=DEVICE))


@case("to_cpu-quoted", "clean", "refused", src.D2H, family="to_cpu", variant="quoted")
def _to_cpu():
    def step(q):
        greedy = q.argmax(-1)
        host = greedy.to("cpu")  # HAZARD
        return greedy, host

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("to_cpu-cpu_method", "clean", "refused", src.D2H, family="to_cpu", variant="spelling")
def _to_cpu_method():
    sent: list = []

    def step(logits):
        probs = logits.softmax(-1)
        sent.append(probs.detach().cpu().numpy())  # HAZARD
        return probs

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("to_cpu-host_copy_policy", "clean", "refused", src.D2H, family="to_cpu",
      variant="method", hazard=nets.HostCopyPolicy.forward)
def _to_cpu_module():
    return nets.HostCopyPolicy(4, 2).to(DEVICE), (torch.randn(8, 4, device=DEVICE),)


@case("to_cpu-helper_to_host", "clean", "refused", src.D2H, family="to_cpu",
      variant="helper", hazard=helpers.to_host)
def _to_cpu_helper():
    def step(v):
        return v * 2, helpers.to_host(v)

    return step, (torch.randn(8, device=DEVICE),)


# ---------------------------------------------------------------- a constant int output


@case("static_int-quoted_batch_size", "clean", "capturable", src.STATIC_INT,
      family="static_int_output", variant="quoted")
def _static_int():
    def step(x):
        y = x.square()
        return y, x.shape[0]

    return step, (torch.randn(8, 3, device=DEVICE),)


@case("static_int-len_in_dict", "clean", "capturable", src.STATIC_INT,
      family="static_int_output", variant="spelling")
def _static_len():
    def step(obs, target):
        loss = (obs.sum(-1) - target).square().mean()
        return {"loss": loss, "n": len(obs)}

    return step, (torch.randn(8, 3, device=DEVICE), torch.randn(8, device=DEVICE))


@case("static_int-sized_head", "clean", "capturable", src.STATIC_INT,
      family="static_int_output", variant="method")
def _static_method():
    return nets.SizedHead(4, 6).to(DEVICE), (torch.randn(8, 4, device=DEVICE),)


@case("static_int-helper_loss_and_count", "clean", "capturable", src.STATIC_INT,
      family="static_int_output", variant="helper")
def _static_helper():
    net = torch.nn.Linear(4, 1).to(DEVICE)

    def step(x, y):
        return helpers.loss_and_count(net(x), y)

    return step, (torch.randn(8, 4, device=DEVICE), torch.randn(8, 1, device=DEVICE))


# ---------------------------------------------------------------- ordinary clean RL steps


@case("clean-ppo_update_sgd", "clean", "capturable", src.CLEAN + "; " + src.SGD + "; "
      + src.CLIP_OK + "; " + src.CATEGORICAL)
def _ppo():
    agent = nets.ActorCritic(8, 4).to(DEVICE)
    opt = torch.optim.SGD(agent.parameters(), lr=1e-3, momentum=0.9)

    def step(obs, act, logp_old, adv, ret):
        _, logp, ent, v = agent.get_action_and_value(obs, act)
        ratio = (logp - logp_old).exp()
        pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        loss = pg + 0.5 * (v - ret).square().mean() - 0.01 * ent.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
        opt.step()
        return loss.detach(), ratio.detach().mean()

    return step, (torch.randn(32, 8, device=DEVICE), torch.randint(0, 4, (32,), device=DEVICE),
                  -torch.rand(32, device=DEVICE) - 1, torch.randn(32, device=DEVICE),
                  torch.randn(32, device=DEVICE))


@case("clean-gae_fixed_horizon", "clean", "capturable",
      "a Python loop over a fixed horizon unrolls to the same kernels every call. "
      + src.CLEAN)
def _gae():
    def step(rewards, values, dones, last_value):
        adv = helpers.gae(rewards, values, dones, last_value)
        return helpers.normalize(adv), adv + values

    t, n = 8, 4
    return step, (torch.randn(t, n, device=DEVICE), torch.randn(t, n, device=DEVICE),
                  (torch.rand(t, n, device=DEVICE) < 0.1).float(), torch.randn(n, device=DEVICE))


@case("clean-device_ring_buffer", "clean", "capturable",
      "the write pointer is a device tensor advanced in place (index_copy_, remainder_). "
      + src.CLEAN)
def _ring():
    rb = nets.DeviceRingBuffer(5, 3, DEVICE)

    def step(obs):
        rb.add(obs)
        return rb.obs.sum(0)

    return step, (torch.randn(3, device=DEVICE),)


@case("clean-replay_sample_randint", "clean", "capturable", src.RNG_OK)
def _sample():
    storage = torch.randn(100, 6, device=DEVICE)
    rewards = torch.randn(100, device=DEVICE)

    def step(qnet_weight):
        idx = torch.randint(0, storage.shape[0], (32,), device=storage.device)
        obs, r = storage[idx], rewards[idx]
        return (obs @ qnet_weight).max(-1).values + r

    return step, (torch.randn(6, 3, device=DEVICE),)


@case("clean-double_dqn_target", "clean", "capturable", src.CLEAN)
def _double_dqn():
    online = helpers.mlp(6, 32, 4).to(DEVICE)
    target = helpers.mlp(6, 32, 4).to(DEVICE)

    def step(next_obs, reward, done):
        with torch.no_grad():
            best = online(next_obs).argmax(-1, keepdim=True)
            q_next = target(next_obs).gather(-1, best).squeeze(-1)
            return reward + 0.99 * (1.0 - done) * q_next

    return step, (torch.randn(32, 6, device=DEVICE), torch.randn(32, device=DEVICE),
                  (torch.rand(32, device=DEVICE) < 0.05).float())


@case("clean-polyak_foreach_lerp", "clean", "capturable",
      "torch._foreach_lerp_ with a constant weight. " + src.CLEAN)
def _polyak():
    online = helpers.mlp(4, 16, 2).to(DEVICE)
    target = helpers.mlp(4, 16, 2).to(DEVICE)

    def step(obs):
        helpers.soft_update(list(target.parameters()), list(online.parameters()), 0.005)
        return target(obs)

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("clean-sac_actor_loss", "clean", "capturable",
      src.RNG_OK + "; Normal(validate_args=False) skips the checks")
def _sac_actor():
    actor = helpers.mlp(5, 32, 4).to(DEVICE)
    critic = helpers.mlp(7, 32, 1).to(DEVICE)
    log_alpha = torch.zeros((), device=DEVICE)

    def step(obs):
        mu, log_std = actor(obs).chunk(2, -1)
        dist = torch.distributions.Normal(mu, log_std.clamp(-5, 2).exp(), validate_args=False)
        u = dist.rsample()
        a = torch.tanh(u)
        logp = (dist.log_prob(u) - torch.log1p(-a.square() + 1e-6)).sum(-1)
        q = critic(torch.cat([obs, a], -1)).squeeze(-1)
        return (log_alpha.exp() * logp - q).mean()

    return step, (torch.randn(16, 5, device=DEVICE),)


@case("clean-dropout_train_mode", "clean", "capturable",
      "dropout draws its mask from the default generator. " + src.RNG_OK)
def _dropout():
    net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                              torch.nn.Linear(32, 2)).to(DEVICE).train()

    def step(x):
        return net(x)

    return step, (torch.randn(16, 6, device=DEVICE),)


@case("clean-gumbel_softmax_hard", "clean", "capturable",
      "torch/nn/functional.py gumbel_softmax: exponential_ noise, softmax, max and scatter, "
      "all on the device. " + src.RNG_OK)
def _gumbel():
    def step(logits):
        return F.gumbel_softmax(logits, tau=0.5, hard=True)

    return step, (torch.randn(8, 5, device=DEVICE),)


@case("clean-categorical_entropy_bonus", "clean", "capturable", src.CATEGORICAL)
def _entropy():
    def step(logits, adv, act):
        dist = Categorical(logits=logits, validate_args=False)
        return -(dist.log_prob(act) * adv).mean() - 0.01 * dist.entropy().mean()

    return step, (torch.randn(16, 4, device=DEVICE), torch.randn(16, device=DEVICE),
                  torch.randint(0, 4, (16,), device=DEVICE))


@case("clean-topk_beam", "clean", "capturable",
      "topk has a fixed output size (k). " + src.CLEAN)
def _topk():
    def step(scores):
        vals, idx = scores.topk(3, dim=-1)
        return vals.softmax(-1), idx

    return step, (torch.randn(8, 10, device=DEVICE),)


@case("clean-nstep_returns_unfold", "clean", "capturable",
      "unfold and a fixed discount vector made with device=: fixed shapes, device ops. "
      + src.CLEAN)
def _nstep():
    def step(rewards):
        n = 3
        discounts = 0.99 ** torch.arange(n, device=rewards.device, dtype=rewards.dtype)
        windows = rewards.unfold(0, n, 1)
        return windows @ discounts

    return step, (torch.randn(16, device=DEVICE),)


@case("clean-value_clipping_loss", "clean", "capturable", src.CLEAN)
def _value_clip():
    def step(v, v_old, ret):
        clipped = v_old + (v - v_old).clamp(-0.2, 0.2)
        return 0.5 * torch.max((v - ret).square(), (clipped - ret).square()).mean()

    return step, (torch.randn(32, device=DEVICE), torch.randn(32, device=DEVICE),
                  torch.randn(32, device=DEVICE))


@case("clean-reward_scaling_inplace", "clean", "capturable",
      "a running discounted return kept in device buffers, updated in place. " + src.CLEAN)
def _reward_scaling():
    ret = torch.zeros(8, device=DEVICE)
    var = torch.ones((), device=DEVICE)

    def step(reward, done):
        ret.mul_(0.99 * (1.0 - done)).add_(reward)
        var.lerp_(ret.square().mean(), 0.01)
        return reward / (var.sqrt() + 1e-8)

    return step, (torch.randn(8, device=DEVICE), (torch.rand(8, device=DEVICE) < 0.1).float())
