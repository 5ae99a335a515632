"""Class 2: optimizers. A non-capturable optimizer stepped inside a capture meets torch's
capture health check; a capturable one must be rehearsed, not crash the tool."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from . import helpers, nets
from . import sources as src
from .registry import DEVICE, case

SAYS = ("capturable=True",)


def _regression(make_opt):
    """A regression step with the optimizer ``make_opt`` builds (the hazard at ``step()``)."""
    net = helpers.mlp(4, 16, 1).to(DEVICE)
    opt = make_opt(net.parameters())
    return net, opt, (torch.randn(32, 4, device=DEVICE), torch.randn(32, 1, device=DEVICE))


# ---------------------------------------------------------------- not capturable: refused


@case("adam-fused_not_capturable", "optimizer", "refused", src.HEALTH_CHECK,
      family="fused_adam_not_capturable", variant="quoted", says=SAYS)
def _fused_adam():
    net, opt, args = _regression(lambda p: torch.optim.Adam(p, lr=3e-4, fused=True))

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()  # HAZARD
        return loss.detach()

    return step, args


@case("adamw-fused_not_capturable", "optimizer", "refused", src.HEALTH_CHECK + " (AdamW "
      "subclasses Adam)", family="fused_adam_not_capturable", variant="spelling", says=SAYS)
def _fused_adamw():
    net, opt, args = _regression(
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True))

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(net(x), y).backward()
        opt.step()  # HAZARD
        return net[0].weight.detach().norm()

    return step, args


@case("adam-default_foreach", "optimizer", "refused", src.HEALTH_CHECK,
      family="fused_adam_not_capturable", variant="spelling", says=SAYS)
def _default_adam():
    net, opt, args = _regression(lambda p: torch.optim.Adam(p, lr=3e-4, eps=1e-5))

    def step(x, y):
        loss = F.smooth_l1_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()  # HAZARD
        return loss.detach()

    return step, args


@case("rmsprop-a2c_default", "optimizer", "refused", src.HEALTH_CHECK,
      family="fused_adam_not_capturable", variant="spelling", says=SAYS)
def _rmsprop():
    net, opt, args = _regression(lambda p: torch.optim.RMSprop(p, lr=7e-4, alpha=0.99,
                                                               eps=1e-5))

    def step(x, y):
        loss = 0.5 * (net(x) - y).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()  # HAZARD
        return loss.detach()

    return step, args


@case("adam-fused_dqn_agent", "optimizer", "refused", src.HEALTH_CHECK,
      family="fused_adam_not_capturable", variant="method", hazard=nets.DQNAgent.update,
      says=SAYS)
def _fused_method():
    agent = nets.DQNAgent(6, 3, partial(torch.optim.Adam, lr=1e-3, fused=True))
    agent.q.to(DEVICE)
    return agent.update, (torch.randn(32, 6, device=DEVICE),
                          torch.randint(0, 3, (32,), device=DEVICE),
                          torch.randn(32, device=DEVICE))


@case("adam-fused_helper", "optimizer", "refused", src.HEALTH_CHECK,
      family="fused_adam_not_capturable", variant="helper", hazard=helpers.apply_gradients,
      says=SAYS)
def _fused_helper():
    net, opt, args = _regression(lambda p: torch.optim.Adam(p, lr=3e-4, fused=True))

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        helpers.apply_gradients(opt, loss)
        return loss.detach()

    return step, args


# ---------------------------------------------------------------- capturable: rehearse it


def _dev_lr(lr: float) -> torch.Tensor:
    return torch.tensor(lr, device=DEVICE)


@case("adam-foreach_capturable", "optimizer", "capturable", src.CAPTURABLE,
      family="capturable_adam", variant="quoted")
def _capturable_foreach():
    net, opt, args = _regression(
        lambda p: torch.optim.Adam(p, lr=_dev_lr(3e-4), foreach=True, capturable=True))

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, args


@case("adamw-capturable_default_impl", "optimizer", "capturable", src.CAPTURABLE,
      family="capturable_adam", variant="spelling")
def _capturable_adamw():
    net, opt, args = _regression(
        lambda p: torch.optim.AdamW(p, lr=_dev_lr(1e-3), weight_decay=0.01, capturable=True))

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(net(x), y).backward()
        opt.step()
        return net[0].weight.detach().norm()

    return step, args


@case("adam-single_tensor_capturable", "optimizer", "capturable", src.CAPTURABLE,
      family="capturable_adam", variant="spelling")
def _capturable_single():
    net, opt, args = _regression(
        lambda p: torch.optim.Adam(p, lr=1e-3, foreach=False, capturable=True))

    def step(x, y):
        loss = F.huber_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, args


@case("adam-fused_capturable", "optimizer", "capturable", src.CAPTURABLE,
      family="capturable_adam", variant="spelling")
def _capturable_fused():
    net, opt, args = _regression(
        lambda p: torch.optim.Adam(p, lr=_dev_lr(3e-4), fused=True, capturable=True))

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, args


@case("adam-capturable_dqn_agent", "optimizer", "capturable", src.CAPTURABLE,
      family="capturable_adam", variant="method")
def _capturable_method():
    agent = nets.DQNAgent(6, 3, partial(torch.optim.Adam, lr=_dev_lr(1e-3), capturable=True))
    agent.q.to(DEVICE)
    return agent.update, (torch.randn(32, 6, device=DEVICE),
                          torch.randint(0, 3, (32,), device=DEVICE),
                          torch.randn(32, device=DEVICE))


@case("adam-capturable_helper", "optimizer", "capturable", src.CAPTURABLE,
      family="capturable_adam", variant="helper")
def _capturable_helper():
    net, opt, args = _regression(
        lambda p: torch.optim.Adam(p, lr=_dev_lr(3e-4), foreach=True, capturable=True))

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        helpers.apply_gradients(opt, loss)
        return loss.detach()

    return step, args


# ---------------------------------------------------------------- other optimizers, clipping


@case("sgd-nesterov_momentum", "optimizer", "capturable", src.SGD)
def _sgd():
    net, opt, args = _regression(lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9,
                                                           nesterov=True))

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, args


@case("clip_grad-error_if_nonfinite", "optimizer", "refused", src.CLIP)
def _clip_nonfinite():
    net, opt, args = _regression(lambda p: torch.optim.SGD(p, lr=0.01))

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5, error_if_nonfinite=True)  # HAZARD
        opt.step()
        return loss.detach()

    return step, args


@case("clip_grad-default_sgd", "optimizer", "capturable", src.CLIP_OK + "; " + src.SGD)
def _clip_default():
    net, opt, args = _regression(lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        return loss.detach(), norm

    return step, args
