"""Class 5: host memory. A blocking copy between the device and pageable host memory syncs; an
op on a host tensor made before the capture (a step counter, a learning rate) is CPU work that
runs once, at capture; and the plain host reads (``.item()``, ``bool``, ``print``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import helpers, nets
from . import sources as src
from .registry import DEVICE, case

# ---------------------------------------------------------------- device to pageable host


@case("d2h-quoted_empty_copy", "host_memory", "refused", src.D2H,
      family="d2h_into_pageable", variant="quoted")
def _d2h():
    def step(x):
        host = torch.empty(4)
        host.copy_(x.sum(0))  # HAZARD
        return x * 2

    return step, (torch.randn(3, 4, device=DEVICE),)


@case("d2h-slice_assign_into_host_stats", "host_memory", "refused", src.D2H,
      family="d2h_into_pageable", variant="spelling")
def _d2h_setitem():
    host_stats = torch.zeros(3, device="cpu")
    net = helpers.mlp(4, 8, 1).to(DEVICE)

    def step(x, y):
        pred = net(x)
        loss = F.mse_loss(pred, y)
        host_stats[:] = torch.stack([loss, pred.mean(), pred.std()]).detach()  # HAZARD
        return loss

    return step, (torch.randn(16, 4, device=DEVICE), torch.randn(16, 1, device=DEVICE))


@case("d2h-empty_like_on_cpu", "host_memory", "refused", src.D2H,
      family="d2h_into_pageable", variant="spelling")
def _d2h_empty_like():
    def step(q):
        snapshot = torch.empty_like(q, device="cpu")
        snapshot.copy_(q)  # HAZARD
        return q.max(-1).values

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("d2h-metrics_logger", "host_memory", "refused", src.D2H,
      family="d2h_into_pageable", variant="method", hazard=nets.MetricsLogger.forward)
def _d2h_method():
    return nets.MetricsLogger(), (torch.randn((), device=DEVICE), torch.rand((), device=DEVICE),
                                  torch.rand((), device=DEVICE))


@case("d2h-helper_stash", "host_memory", "refused", src.D2H,
      family="d2h_into_pageable", variant="helper", hazard=helpers.stash_on_host)
def _d2h_helper():
    host_buf = torch.zeros(8, device="cpu")

    def step(values):
        clipped = values.clamp(-1, 1)
        helpers.stash_on_host(host_buf, clipped)
        return clipped

    return step, (torch.randn(8, device=DEVICE),)


# ---------------------------------------------------------------- a host step counter


@case("cpu_counter-bias_correction", "host_memory", "replays_differ", src.CPU_OP,
      family="cpu_step_counter", variant="quoted")
def _cpu_counter():
    t = torch.zeros((), device="cpu")
    m = torch.zeros(4, device=DEVICE)

    def step(g):
        nonlocal t
        t += 1  # HAZARD
        m.mul_(0.9).add_(g, alpha=0.1)
        return m / (1 - 0.9 ** t)

    return step, (torch.randn(4, device=DEVICE),)


@case("cpu_counter-copy_increment", "host_memory", "replays_differ", src.CPU_OP,
      family="cpu_step_counter", variant="spelling")
def _cpu_counter_copy():
    steps = torch.zeros((), dtype=torch.long, device="cpu")
    net = torch.nn.Linear(4, 1).to(DEVICE)

    def step(x):
        steps.copy_(steps + 1)  # HAZARD
        warmup = torch.clamp(steps / 10.0, max=1.0)
        return net(x) * warmup

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("cpu_counter-bias_corrected_ema", "host_memory", "replays_differ", src.CPU_OP,
      family="cpu_step_counter", variant="method", hazard=nets.BiasCorrectedEMA.forward)
def _cpu_counter_method():
    return nets.BiasCorrectedEMA(4).to(DEVICE), (torch.randn(4, device=DEVICE),)


@case("cpu_counter-helper_advance", "host_memory", "replays_differ", src.CPU_OP,
      family="cpu_step_counter", variant="helper", hazard=helpers.advance_counter)
def _cpu_counter_helper():
    counter = torch.zeros((), device="cpu")

    def step(x):
        n = helpers.advance_counter(counter)
        return x / n.clamp(min=1.0)

    return step, (torch.randn(8, device=DEVICE),)


@case("device_counter-bias_correction", "host_memory", "capturable",
      "the counter is a device tensor: its increment is a recorded kernel. " + src.CLEAN)
def _device_counter():
    t = torch.zeros((), device=DEVICE)
    m = torch.zeros(4, device=DEVICE)

    def step(g):
        t.add_(1)
        m.mul_(0.9).add_(g, alpha=0.1)
        return m / (1 - torch.pow(0.9, t))

    return step, (torch.randn(4, device=DEVICE),)


# ---------------------------------------------------------------- a host learning-rate tensor


def _net_and_batch():
    net = helpers.mlp(4, 16, 1).to(DEVICE)
    return net, list(net.parameters()), (torch.randn(32, 4, device=DEVICE),
                                         torch.randn(32, 1, device=DEVICE))


@case("cpu_lr-inplace_decay", "host_memory", "replays_differ", src.CPU_OP,
      family="cpu_lr_tensor", variant="quoted")
def _cpu_lr():
    net, params, batch = _net_and_batch()
    lr = torch.tensor(0.1, device="cpu")

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        grads = torch.autograd.grad(loss, params)
        lr.mul_(0.9)  # HAZARD
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(g * lr)
        return loss.detach(), params[-1].detach().clone()

    return step, batch


@case("cpu_lr-copy_schedule", "host_memory", "replays_differ", src.CPU_OP,
      family="cpu_lr_tensor", variant="spelling")
def _cpu_lr_copy():
    net, params, batch = _net_and_batch()
    lr = torch.full((), 0.2, device="cpu")

    def step(x, y):
        lr.copy_(lr * 0.5 + 0.01)  # HAZARD
        loss = F.mse_loss(net(x), y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(-lr * g)
        return loss.detach(), params[-1].detach().clone()

    return step, batch


@case("cpu_lr-host_lr_trainer", "host_memory", "replays_differ", src.CPU_OP,
      family="cpu_lr_tensor", variant="method", hazard=nets.HostLRSGD.step)
def _cpu_lr_method():
    net, _, batch = _net_and_batch()
    return nets.HostLRSGD(net, lr=0.1, gamma=0.5).step, batch


@case("cpu_lr-helper_decay", "host_memory", "replays_differ", src.CPU_OP,
      family="cpu_lr_tensor", variant="helper", hazard=helpers.decay_lr)
def _cpu_lr_helper():
    net, params, batch = _net_and_batch()
    lr = torch.tensor(0.1, device="cpu")

    def step(x, y):
        for p in params:
            p.grad = None
        F.mse_loss(net(x), y).backward()
        rate = helpers.decay_lr(lr, 0.8)
        with torch.no_grad():
            for p in params:
                p.sub_(p.grad * rate)
        return params[0].detach().sum()

    return step, batch


# ---------------------------------------------------------------- plain host reads


@case("host_read-item_logging", "host_memory", "refused", src.HOST_READ)
def _item():
    log: list[float] = []
    net = helpers.mlp(4, 8, 1).to(DEVICE)

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        log.append(loss.item())  # HAZARD
        return loss

    return step, (torch.randn(8, 4, device=DEVICE), torch.randn(8, 1, device=DEVICE))


@case("host_read-helper_log_scalar", "host_memory", "refused", src.HOST_READ,
      hazard=helpers.log_scalar)
def _item_helper():
    log: list[float] = []

    def step(ratio):
        kl = (ratio - 1 - ratio.log()).mean()
        helpers.log_scalar(log, kl)
        return kl

    return step, (torch.rand(16, device=DEVICE) + 0.5,)


@case("host_read-early_stop_on_kl", "host_memory", "refused", src.HOST_READ)
def _branch():
    def step(logp_old, logp_new, adv):
        approx_kl = (logp_old - logp_new).mean()
        if approx_kl > 0.02:  # HAZARD
            return torch.zeros_like(adv).sum()
        return -(torch.exp(logp_new - logp_old) * adv).mean()

    return step, (torch.randn(16, device=DEVICE), torch.randn(16, device=DEVICE),
                  torch.randn(16, device=DEVICE))


@case("host_read-print_tensor", "host_memory", "refused", src.HOST_READ)
def _print():
    def step(values):
        returns = values.cumsum(0)
        print(f"returns: {returns}")  # HAZARD
        return returns

    return step, (torch.randn(8, device=DEVICE),)


@case("host_read-tolist_actions", "host_memory", "refused", src.HOST_READ)
def _tolist():
    sent: list = []

    def step(logits):
        actions = logits.argmax(-1)
        sent.append(actions.tolist())  # HAZARD
        return actions

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("host_index-python_list", "host_memory", "refused", src.LIST_INDEX)
def _list_index():
    def step(q):
        chosen = q[[0, 2, 3]]  # HAZARD
        return chosen.max(-1).values

    return step, (torch.randn(6, 4, device=DEVICE),)


@case("host_index-cpu_index_tensor", "host_memory", "refused", src.LIST_INDEX)
def _cpu_index():
    envs = torch.tensor([1, 3], device="cpu")

    def step(obs):
        subset = obs[envs]  # HAZARD
        return subset.mean(0)

    return step, (torch.randn(6, 4, device=DEVICE),)


@case("pinned-alloc_in_step", "host_memory", "capturable", src.PINNED,
      unsure="measured on one GPU and torch version; the first judge run (2026-11-25)")
def _pinned():
    def step(x):
        staging = torch.empty(x.shape, pin_memory=True)
        staging.copy_(x, non_blocking=True)
        return x + 1

    return step, (torch.randn(8, device=DEVICE),)


@case("pinned-preallocated_async_copy", "host_memory", "capturable", src.PINNED_ASYNC)
def _pinned_once():
    buffers = {}  # made at the first call, a warm-up, and kept

    def step(x):
        y = x * 2
        if "staging" not in buffers:
            buffers["staging"] = torch.empty(8, pin_memory=True)
        buffers["staging"].copy_(y, non_blocking=True)
        return y

    return step, (torch.randn(8, device=DEVICE),)


@case("pinned-blocking_copy", "host_memory", "refused", src.PINNED_BLOCKING)
def _pinned_blocking():
    buffers = {}

    def step(x):
        y = x * 2
        if "staging" not in buffers:
            buffers["staging"] = torch.empty(8, pin_memory=True)
        buffers["staging"].copy_(y)  # HAZARD
        return y

    return step, (torch.randn(8, device=DEVICE),)
