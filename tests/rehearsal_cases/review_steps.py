"""62 more steps, written by a reviewer of issue 37's rehearsal (2026-11-25) to hunt its false
verdicts on code the case set does not hold: ``CASES`` is (name, expected verdict: "ok",
"refused" or "replays_differ", why, factory); a factory returns (fn, args), and a hazard's
line is marked ``# HAZARD`` in its factory (or, for a class's method, in the class).
tests/test_rehearsal_review.py holds ``labkit.rehearse`` to them."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Bernoulli, Categorical, Normal

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CASES = []


def case(expect, why):
    def reg(f):
        CASES.append((f.__name__, expect, why, f))
        return f
    return reg


def mlp(i, h, o):
    return nn.Sequential(nn.Linear(i, h), nn.Tanh(), nn.Linear(h, o)).to(dev)


def dlr(x):
    return torch.tensor(x, device=dev)

# ------------------------------------------------------------------ clean


@case("ok",
      "capturable Adam with tensor lr, Categorical(validate_args=False), foreach clip: all "
      "device ops")
def c01_ppo_update():
    net = mlp(8, 32, 5)
    opt = torch.optim.Adam(net.parameters(), lr=dlr(3e-4), capturable=True, foreach=True)

    def step(obs, act, old_logp, adv, ret):
        opt.zero_grad(set_to_none=True)
        out = net(obs)
        logits, v = out[:, :4], out[:, 4]
        dist = Categorical(logits=logits, validate_args=False)
        logp = dist.log_prob(act)
        ratio = (logp - old_logp).exp()
        pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        vloss = 0.5 * (ret - v).pow(2).mean()
        loss = pg + vloss - 0.01 * dist.entropy().mean()
        loss.backward()
        nn.utils.clip_grad_norm_(net.parameters(), 0.5, foreach=True)
        opt.step()
        return loss.detach()

    return step, (torch.randn(16, 8, device=dev), torch.randint(0, 4, (16,), device=dev),
                  torch.randn(16, device=dev), torch.randn(16, device=dev),
                  torch.randn(16, device=dev))


@case("ok", "fixed-horizon GAE over device tensors, torch.where on dones")
def c02_gae():
    gamma, lam = 0.99, 0.95

    def step(rew, val, done, last_val):
        T = rew.shape[0]
        adv = torch.zeros_like(rew)
        gae = torch.zeros_like(last_val)
        for t in reversed(range(T)):
            nxt = last_val if t == T - 1 else val[t + 1]
            nonterm = torch.where(done[t], 0.0, 1.0)
            delta = rew[t] + gamma * nxt * nonterm - val[t]
            gae = delta + gamma * lam * nonterm * gae
            adv[t] = gae
        return adv, adv + val

    return step, (torch.randn(8, 4, device=dev), torch.randn(8, 4, device=dev),
                  torch.rand(8, 4, device=dev) < 0.1, torch.randn(4, device=dev))


class RunningNorm:
    def __init__(self, n):
        self.mean = torch.zeros(n, device=dev)
        self.var = torch.ones(n, device=dev)
        self.count = torch.full((), 1e-4, device=dev)

    @torch.no_grad()
    def update(self, x):
        bm, bv, bn = x.mean(0), x.var(0, unbiased=False), x.shape[0]
        delta = bm - self.mean
        tot = self.count + bn
        new_mean = self.mean + delta * bn / tot
        m2 = self.var * self.count + bv * bn + delta.pow(2) * self.count * bn / tot
        self.mean.copy_(new_mean)
        self.var.copy_(m2 / tot)
        self.count.copy_(tot)

    def __call__(self, x):
        return ((x - self.mean) / (self.var + 1e-8).sqrt()).clamp(-10, 10)


@case("ok", "running mean/var/count are device tensors written in place")
def c03_running_norm():
    norm = RunningNorm(6)

    def step(obs):
        norm.update(obs)
        return norm(obs)

    return step, (torch.randn(32, 6, device=dev),)


@case("ok", "ring buffer indexed by a device pointer tensor, index_copy_")
def c04_replay_write():
    cap, n = 64, 8
    buf = torch.zeros(cap, 4, device=dev)
    ptr = torch.zeros((), dtype=torch.long, device=dev)

    def step(x):
        idx = (ptr + torch.arange(n, device=dev)) % cap
        buf.index_copy_(0, idx, x)
        ptr.add_(n).remainder_(cap)
        return buf.sum()

    return step, (torch.randn(8, 4, device=dev),)


@case("ok", "linear LR decay computed on device into the capturable optimizer's tensor lr")
def c05_tensor_lr_schedule():
    net = mlp(4, 16, 1)
    lr = dlr(1e-3)
    it = torch.zeros((), device=dev)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, capturable=True)

    def step(x, y):
        it.add_(1)
        lr.copy_(1e-3 * (1 - it / 1000).clamp(min=0.0))
        loss = F.mse_loss(net(x).squeeze(-1), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, (torch.randn(16, 4, device=dev), torch.randn(16, device=dev))


@case("ok",
      "SAC actor: Normal(validate_args=False).rsample + tanh correction, alpha from log_alpha "
      "on device")
def c06_sac_actor():
    actor = mlp(6, 32, 4)
    log_alpha = torch.zeros((), device=dev, requires_grad=True)

    def step(obs):
        mu, log_std = actor(obs).chunk(2, -1)
        std = log_std.clamp(-5, 2).exp()
        d = Normal(mu, std, validate_args=False)
        u = d.rsample()
        a = torch.tanh(u)
        logp = (d.log_prob(u) - torch.log1p(-a.pow(2) + 1e-6)).sum(-1)
        loss = (log_alpha.exp().detach() * logp - a.sum(-1)).mean()
        loss.backward()
        return loss.detach()

    return step, (torch.randn(16, 6, device=dev),)


@case("ok", "DQN TD step with SGD momentum (no capture health check, no step counter)")
def c07_dqn_sgd():
    q = mlp(5, 32, 3)
    tgt = mlp(5, 32, 3)
    opt = torch.optim.SGD(q.parameters(), lr=1e-2, momentum=0.9)

    def step(o, a, r, o2, d):
        with torch.no_grad():
            y = r + 0.99 * (1 - d) * tgt(o2).max(1).values
        qa = q(o).gather(1, a.unsqueeze(1)).squeeze(1)
        loss = F.smooth_l1_loss(qa, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return step, (torch.randn(16, 5, device=dev), torch.randint(0, 3, (16,), device=dev),
                  torch.randn(16, device=dev), torch.randn(16, 5, device=dev),
                  (torch.rand(16, device=dev) < 0.1).float())


@case("ok", "scatter_add_ of rewards into per-episode slots: fixed shapes")
def c08_scatter_add():
    def step(rew, ep):
        tot = torch.zeros(8, device=dev)
        tot.scatter_add_(0, ep, rew)
        return tot / (torch.zeros(8, device=dev).scatter_add_(0, ep, torch.ones_like(rew)) + 1)

    return step, (torch.randn(32, device=dev), torch.randint(0, 8, (32,), device=dev))


@case("ok", "count-based bonus with index_add_ into a device table")
def c09_index_add():
    counts = torch.zeros(100, device=dev)

    def step(states):
        counts.index_add_(0, states, torch.ones(states.shape[0], device=dev))
        return counts[states].rsqrt()

    return step, (torch.randint(0, 100, (16,), device=dev),)


@case("ok", "discounted sum via cumsum with a fixed discount vector made on device")
def c10_cumsum_returns():
    def step(rew):
        T = rew.shape[-1]
        disc = 0.99 ** torch.arange(T, device=rew.device, dtype=rew.dtype)
        return (rew * disc).flip(-1).cumsum(-1).flip(-1) / disc

    return step, (torch.randn(4, 10, device=dev),)


@case("ok", "GRU policy forward+backward, capturable Adam")
def c11_gru():
    gru = nn.GRU(6, 16, batch_first=True).to(dev)
    head = nn.Linear(16, 3).to(dev)
    params = list(gru.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=dlr(1e-3), capturable=True)

    def step(x, h0, tgt):
        out, h = gru(x, h0)
        loss = F.cross_entropy(head(out[:, -1]), tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach(), h.detach()

    return step, (torch.randn(4, 5, 6, device=dev), torch.zeros(1, 4, 16, device=dev),
                  torch.randint(0, 3, (4,), device=dev))


@case("ok", "LSTMCell unroll with the carried state copied in place")
def c12_lstmcell():
    cell = nn.LSTMCell(4, 8).to(dev)
    h = torch.zeros(2, 8, device=dev)
    c = torch.zeros(2, 8, device=dev)

    @torch.no_grad()
    def step(xs):
        hh, cc = h, c
        for t in range(xs.shape[0]):
            hh, cc = cell(xs[t], (hh, cc))
        h.copy_(hh)
        c.copy_(cc)
        return hh

    return step, (torch.randn(3, 2, 4, device=dev),)


@case("ok", "LayerNorm + Dropout(train) with autograd: dropout draws on the default generator")
def c13_layernorm_dropout():
    net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Dropout(0.1),
                        nn.Linear(32, 1)).to(dev).train()

    def step(x, y):
        loss = F.mse_loss(net(x).squeeze(-1), y)
        loss.backward()
        return loss.detach()

    return step, (torch.randn(16, 8, device=dev), torch.randn(16, device=dev))


@case("ok", "AMP-style code with autocast and GradScaler disabled (fp32): scaler.step is opt.step")
def c14_amp_disabled():
    net = mlp(4, 16, 1)
    opt = torch.optim.Adam(net.parameters(), lr=dlr(1e-3), capturable=True)
    scaler = torch.amp.GradScaler("cuda", enabled=False)

    def step(x, y):
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=False):
            loss = F.mse_loss(net(x).squeeze(-1), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(net.parameters(), 1.0, foreach=True)
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return step, (torch.randn(16, 4, device=dev), torch.randn(16, device=dev))


@case("ok", "WGAN critic weight clipping with clamp_ in place")
def c15_clamp_weights():
    critic = mlp(4, 16, 1)
    opt = torch.optim.RMSprop(critic.parameters(), lr=dlr(5e-5), capturable=True)

    def step(real, fake):
        loss = critic(fake).mean() - critic(real).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for p in critic.parameters():
                p.clamp_(-0.01, 0.01)
        return loss.detach()

    return step, (torch.randn(16, 4, device=dev), torch.randn(16, 4, device=dev))


@case("ok", "epsilon-greedy with a device epsilon decayed in place")
def c16_eps_device():
    q = mlp(4, 16, 3)
    eps = dlr(1.0)

    @torch.no_grad()
    def step(obs):
        eps.mul_(0.99).clamp_(min=0.05)
        greedy = q(obs).argmax(-1)
        rand = torch.randint(0, 3, greedy.shape, device=dev)
        return torch.where(torch.rand(greedy.shape, device=dev) < eps, rand, greedy)

    return step, (torch.randn(16, 4, device=dev),)


@case("ok",
      "torch.quantile(x, 0.9) on CUDA: the q range check runs only for CPU tensors (Sorting.cpp"
      " quantile_impl)")
def c17_quantile_clip():
    def step(adv):
        hi = torch.quantile(adv, 0.9)
        lo = torch.quantile(adv, 0.1)
        return adv.clamp(lo, hi)

    return step, (torch.randn(64, device=dev),)


@case("ok", "Bernoulli(logits, validate_args=False).sample -> torch.bernoulli: device RNG, no read")
def c18_bernoulli():
    net = mlp(4, 16, 2)

    @torch.no_grad()
    def step(obs):
        d = Bernoulli(logits=net(obs), validate_args=False)
        a = d.sample()
        return a, d.log_prob(a).sum(-1)

    return step, (torch.randn(16, 4, device=dev),)


@case("ok",
      "prioritized sampling: cumsum + searchsorted with device uniforms, IS weights with a "
      "device beta")
def c19_per_sample():
    beta = dlr(0.4)

    @torch.no_grad()
    def step(prio):
        p = prio.pow(0.6)
        cdf = p.cumsum(0)
        u = torch.rand(16, device=dev) * cdf[-1]
        idx = torch.searchsorted(cdf, u).clamp_(max=prio.shape[0] - 1)
        w = (prio.shape[0] * p[idx] / cdf[-1]).pow(-beta)
        beta.add_(0.001).clamp_(max=1.0)
        return idx, w / w.max()

    return step, (torch.rand(128, device=dev) + 0.01,)


@case("ok", "behaviour cloning CE with label_smoothing, accuracy kept as a device tensor")
def c20_bc_ce():
    net = mlp(6, 32, 4)

    def step(x, y):
        logits = net(x)
        loss = F.cross_entropy(logits, y, label_smoothing=0.1)
        loss.backward()
        acc = (logits.argmax(-1) == y).float().mean()
        return loss.detach(), acc

    return step, (torch.randn(16, 6, device=dev), torch.randint(0, 4, (16,), device=dev))

# ------------------------------------------------------------------ hazards


@case("refused", "bool(approx_kl > target) is a host read: the capture cannot wait")
def h01_kl_early_stop():
    net = mlp(6, 16, 3)

    def step(obs, act, old_logp):
        logp = Categorical(logits=net(obs), validate_args=False).log_prob(act)
        approx_kl = (old_logp - logp).mean()
        if approx_kl > 0.02:  # HAZARD
            return approx_kl.detach()
        (-logp.mean()).backward()
        return approx_kl.detach()

    return step, (torch.randn(16, 6, device=dev), torch.randint(0, 3, (16,), device=dev),
                  torch.randn(16, device=dev))


class PyCountNorm:
    def __init__(self, n):
        self.mean = torch.zeros(n, device=dev)
        self.count = 0

    @torch.no_grad()
    def update(self, x):
        self.count += x.shape[0]
        self.mean.add_((x.mean(0) - self.mean) * (x.shape[0] / self.count))  # HAZARD


@case("replays_differ",
      "Python int count changes each call: the weight x.shape[0]/count is frozen at capture")
def h02_py_count_norm():
    norm = PyCountNorm(4)

    def step(x):
        norm.update(x)
        return x - norm.mean

    return step, (torch.randn(8, 4, device=dev),)


@case("replays_differ", "Python ptr slice: every replay writes the capture's slot")
def h03_py_ptr_buffer():
    buf = torch.zeros(64, 4, device=dev)
    st = {"ptr": 0}

    def step(x):
        p = st["ptr"]
        buf[p:p + 8] = x  # HAZARD
        st["ptr"] = (p + 8) % 64
        return buf.sum(0)

    return step, (torch.randn(8, 4, device=dev),)


@case("replays_differ",
      "LambdaLR.step() fills the tensor lr with a host float computed from last_epoch: frozen")
def h04_lambdalr_in_step():
    net = mlp(4, 8, 1)
    opt = torch.optim.Adam(net.parameters(), lr=dlr(1e-3), capturable=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e))

    def step(x, y):
        loss = F.mse_loss(net(x).squeeze(-1), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()  # HAZARD
        return loss.detach()

    return step, (torch.randn(16, 4, device=dev), torch.randn(16, device=dev))


@case("refused",
      "enabled GradScaler.step reads found_inf with .item() (grad_scaler.py _maybe_opt_step)")
def h05_gradscaler_enabled():
    net = mlp(4, 8, 1)
    opt = torch.optim.Adam(net.parameters(), lr=dlr(1e-3), capturable=True, foreach=True)
    scaler = torch.amp.GradScaler(dev.type, init_scale=1024.0)

    def step(x, y):
        loss = F.mse_loss(net(x).squeeze(-1), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)  # HAZARD
        scaler.update()
        return loss.detach()

    return step, (torch.randn(16, 4, device=dev), torch.randn(16, device=dev))


@case("refused", "nonzero has a data-dependent output shape")
def h06_nonzero_reset():
    def step(h, done):
        idx = done.nonzero().squeeze(-1)  # HAZARD
        h = h.clone()
        h[idx] = 0.0
        return h

    return step, (torch.randn(16, 8, device=dev), torch.rand(16, device=dev) < 0.2)


@case("refused", "masked_select output shape depends on the mask")
def h07_masked_select():
    def step(ret, valid):
        v = ret.masked_select(valid)  # HAZARD
        return v.sum() / valid.sum()

    return step, (torch.randn(32, device=dev), torch.rand(32, device=dev) < 0.5)


@case("refused", "torch.unique: dynamic output shape")
def h08_unique_counts():
    def step(states):
        ids, counts = torch.unique(states, return_counts=True)  # HAZARD
        return counts.float().mean()

    return step, (torch.randint(0, 10, (32,), device=dev),)


@case("refused", "print(tensor) formats its values on the host")
def h09_print_loss():
    net = mlp(4, 8, 1)

    def step(x):
        loss = net(x).pow(2).mean()
        print("loss", loss)  # HAZARD
        return loss

    return step, (torch.randn(16, 4, device=dev),)


@case("refused", "torch.cuda.synchronize inside a capture is illegal")
def h10_synchronize():
    net = mlp(4, 8, 1)

    def step(x):
        y = net(x)
        torch.cuda.synchronize()  # HAZARD
        return y

    return step, (torch.randn(16, 4, device=dev),)


@case("refused", "RMSprop default capturable=False: _cuda_graph_capture_health_check raises")
def h11_rmsprop_default():
    net = mlp(4, 8, 1)
    opt = torch.optim.RMSprop(net.parameters(), lr=1e-3)

    def step(x, y):
        loss = F.mse_loss(net(x).squeeze(-1), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()  # HAZARD
        return loss.detach()

    return step, (torch.randn(16, 4, device=dev), torch.randn(16, device=dev))


@case("refused", "torch.tensor(list, device=cuda) inside the step: a pageable H2D copy that syncs")
def h12_tensor_from_list():
    def step(r):
        w = torch.tensor([1.0, 0.5, 0.25, 0.125], device=dev)  # HAZARD
        return (r * w).sum(-1)

    return step, (torch.randn(8, 4, device=dev),)


@case("refused",
      "torch.ones(n) without device= is a CPU tensor; mixing it with a CUDA tensor raises")
def h13_cpu_mask_mixed():
    def step(x):
        keep = torch.ones(x.shape[1])
        keep[0] = 0.0
        return x * keep  # HAZARD

    return step, (torch.randn(8, 4, device=dev),)


@case("refused", "a CUDA torch.Generator not registered with the graph")
def h14_unregistered_gen():
    g = torch.Generator(device=dev)
    g.manual_seed(1)

    def step(mu):
        return mu + 0.1 * torch.randn(mu.shape, generator=g, device=dev)  # HAZARD

    return step, (torch.randn(16, 2, device=dev),)


@case("refused", "Normal with default validate_args checks constraints with a bool() read")
def h15_normal_validated():
    def step(mu, log_std, a):
        d = Normal(mu, log_std.exp())  # HAZARD
        return d.log_prob(a).sum(-1)

    return step, (torch.randn(16, 2, device=dev), torch.randn(16, 2, device=dev),
                  torch.randn(16, 2, device=dev))


@case("refused",
      "Normal.sample() -> torch.normal(Tensor, Tensor): CHECK_NORMAL_TENSOR_STD does "
      "std.min().ge(0).item()")
def h16_normal_sample():
    def step(mu, std):
        d = Normal(mu, std, validate_args=False)
        return d.sample()  # HAZARD

    return step, (torch.randn(16, 2, device=dev), torch.rand(16, 2, device=dev) + 0.1)


class Learner:
    def __init__(self):
        self.net = mlp(4, 8, 2)
        self.ent_coef = 0.01

    def loss(self, obs):
        d = Categorical(logits=self.net(obs), validate_args=False)
        self.ent_coef *= 0.99
        return -self.ent_coef * d.entropy().mean()  # HAZARD


@case("replays_differ", "a Python float coefficient decayed each call is frozen at capture")
def h17_py_ent_coef():
    L = Learner()

    def step(obs):
        loss = L.loss(obs)
        loss.backward()
        return loss.detach()

    return step, (torch.randn(16, 4, device=dev),)


@case("replays_differ", "state rebound each call: replays read the tensor the capture saw")
def h18_rebound_ret_rms():
    st = {"var": torch.ones((), device=dev)}

    def step(ret):
        st["var"] = 0.99 * st["var"] + 0.01 * ret.var()  # HAZARD
        return ret / (st["var"] + 1e-8).sqrt()

    return step, (torch.randn(32, device=dev),)


@case("refused",
      "clip_grad_norm_(error_if_nonfinite=True) reads isnan/isinf of the norm on the host")
def h19_clip_error_nonfinite():
    net = mlp(4, 8, 1)

    def step(x):
        net(x).pow(2).mean().backward()
        return nn.utils.clip_grad_norm_(net.parameters(), 1.0, error_if_nonfinite=True)  # HAZARD

    return step, (torch.randn(16, 4, device=dev),)


@case("refused",
      "torch.linalg.eigh: _linalg_eigh_out calls _linalg_check_errors (info.item) after the "
      "kernel")
def h20_eigh_whitening():
    def step(feats):
        c = feats.T @ feats / feats.shape[0] + 1e-3 * torch.eye(feats.shape[1], device=dev)
        evals, evecs = torch.linalg.eigh(c)  # HAZARD
        return feats @ evecs @ torch.diag(evals.rsqrt()) @ evecs.T

    return step, (torch.randn(64, 6, device=dev),)


@case("refused", "assert on a tensor calls bool(): a host read")
def h21_assert_finite():
    net = mlp(4, 8, 1)

    def step(x):
        loss = net(x).pow(2).mean()
        assert torch.isfinite(loss), "loss blew up"  # HAZARD
        return loss

    return step, (torch.randn(16, 4, device=dev),)


@case("refused", "gamma ** torch.arange(T) with no device is a CPU vector mixed with CUDA rewards")
def h22_arange_no_device():
    def step(rew):
        disc = 0.99 ** torch.arange(rew.shape[-1])
        return (rew * disc).sum(-1)  # HAZARD

    return step, (torch.randn(4, 10, device=dev),)


@case("replays_differ",
      "Python counter branch: target sync every 100 calls is frozen to 'not taken' at capture")
def h23_periodic_target_sync():
    q = mlp(4, 8, 2)
    tgt = mlp(4, 8, 2)
    st = {"t": 0}

    def step(o, o2, r):
        st["t"] += 1
        if st["t"] % 100 == 0:  # HAZARD
            with torch.no_grad():
                for pt, p in zip(tgt.parameters(), q.parameters()):
                    pt.copy_(p)
        with torch.no_grad():
            y = r + 0.99 * tgt(o2).max(-1).values
        loss = F.mse_loss(q(o).max(-1).values, y)
        loss.backward()
        return loss.detach()

    return step, (torch.randn(16, 4, device=dev), torch.randn(16, 4, device=dev),
                  torch.randn(16, device=dev))


@case("refused",
      "torch.randperm(B) with no device: CPU index into CUDA obs (blocking H2D copy of the "
      "index)")
def h24_randperm_cpu_minibatch():
    def step(obs):
        perm = torch.randperm(obs.shape[0])
        return obs[perm[:8]].mean(0)  # HAZARD

    return step, (torch.randn(32, 4, device=dev),)


@case("refused",
      "torch.linalg.pinv for an LSTD/least-squares step: SVD/eigh error check reads info on "
      "host")
def h25_pinv_lstd():
    def step(phi, phi2, r):
        A = phi.T @ (phi - 0.99 * phi2)
        b = phi.T @ r
        return torch.linalg.pinv(A) @ b  # HAZARD

    return step, (torch.randn(32, 5, device=dev), torch.randn(32, 5, device=dev),
                  torch.randn(32, device=dev))


@case("replays_differ",
      "Python float loss scale updated from a Python-side schedule, passed to mul: frozen")
def h26_py_beta_schedule():
    st = {"beta": 0.4}

    @torch.no_grad()
    def step(w):
        st["beta"] = min(1.0, st["beta"] + 0.01)
        return w.pow(-st["beta"])  # HAZARD

    return step, (torch.rand(16, device=dev) + 0.1,)

# ------------------------------------------------------------------ batch 2


class ObsNorm:
    def __init__(self, n):
        self.mean = torch.zeros(n)
        self.var = torch.ones(n)

    def to(self, device):
        for k in ("mean", "var"):
            setattr(self, k, getattr(self, k).to(device))
        return self

    @torch.no_grad()
    def update(self, x):
        self.mean.lerp_(x.mean(0), 0.01)
        self.var.lerp_(x.var(0), 0.01)


@case("ok",
      "normalizer moved with a setattr loop in its own .to(device): its tensors live on the "
      "device")
def c21_setattr_to():
    norm = ObsNorm(4).to(dev)

    def step(x):
        norm.update(x)
        return (x - norm.mean) / norm.var.sqrt()

    return step, (torch.randn(16, 4, device=dev),)


@case("ok",
      "a constant 0-d host scalar (torch.tensor(0.5)) mixed into CUDA ops is legal, never "
      "written")
def c22_zero_d_const():
    half = torch.tensor(0.5)

    def step(x):
        return x * half + 1.0

    return step, (torch.randn(8, device=dev),)


class RunningStats(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            self.count.add_(1)
            self.mean.add_((x.mean(0) - self.mean) / self.count)
        return x - self.mean


@case("ok", "nn.Module given as fn; registered buffers moved by .to(dev), updated in place")
def c23_module_fn():
    m = RunningStats(4).to(dev)
    return m, (torch.randn(8, 4, device=dev),)


@case("ok", "NVTX ranges are host-side annotations: legal during capture")
def c24_nvtx():
    net = mlp(4, 8, 1)

    def step(x):
        torch.cuda.nvtx.range_push("update")
        y = net(x).sum()
        torch.cuda.nvtx.range_pop()
        return y

    return step, (torch.randn(8, 4, device=dev),)


@case("ok",
      "torch's documented idiom: host logging skipped while capturing "
      "(is_current_stream_capturing)")
def c25_skip_log_when_capturing():
    net = mlp(4, 8, 1)
    log = []

    def step(x):
        loss = net(x).pow(2).mean()
        if not torch.cuda.is_current_stream_capturing():
            log.append(loss.item())
        return loss

    return step, (torch.randn(8, 4, device=dev),)


@case("ok", "pixel encoder: Conv2d+ReLU, capturable Adam")
def c26_conv_encoder():
    enc = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.Flatten(),
                        nn.Linear(8 * 7 * 7, 4)).to(dev)
    opt = torch.optim.Adam(enc.parameters(), lr=dlr(1e-3), capturable=True)

    def step(img, y):
        loss = F.mse_loss(enc(img), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, (torch.randn(4, 3, 16, 16, device=dev), torch.randn(4, 4, device=dev))


@case("ok", "transformer policy: scaled_dot_product_attention(is_causal=True)")
def c27_sdpa():
    qkv = nn.Linear(8, 24).to(dev)

    def step(x):
        q, k, v = qkv(x).chunk(3, -1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    return step, (torch.randn(2, 5, 8, device=dev),)


@case("refused", "CUDA event timing: Event.synchronize() inside a capture is illegal")
def h27_event_timing():
    net = mlp(4, 8, 1)

    def step(x):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        y = net(x)
        end.record()
        end.synchronize()  # HAZARD
        return y, start.elapsed_time(end)

    return step, (torch.randn(8, 4, device=dev),)


@case("replays_differ",
      "CPU step counter (no device=) held in a dict: bias correction runs on the CPU once, at "
      "capture")
def h28_cpu_counter_in_dict():
    st = {"t": torch.zeros(())}
    m = torch.zeros(4, device=dev)

    @torch.no_grad()
    def step(g):
        st["t"] += 1  # HAZARD
        m.lerp_(g, 0.1)
        return m / (1 - 0.9 ** st["t"])

    return step, (torch.randn(4, device=dev),)


HOST = torch.device("cpu")  # where metrics are kept, on every machine


@case("refused",
      "x.to(HOST) with HOST = torch.device('cpu'): a blocking D2H copy, the capture cannot wait")
def h29_to_host_constant():
    net = mlp(4, 8, 1)

    def step(x):
        loss = net(x).pow(2).mean()
        return loss, loss.detach().to(HOST)  # HAZARD

    return step, (torch.randn(8, 4, device=dev),)


@case("refused",
      "copy_ into a buffer made with device=HOST (pageable host memory): waits for the device")
def h30_copy_into_host_var():
    net = mlp(4, 8, 1)
    stats = torch.zeros(2, device=HOST)

    def step(x):
        out = net(x)
        stats.copy_(torch.stack([out.mean(), out.std()]))  # HAZARD
        return out

    return step, (torch.randn(8, 4, device=dev),)


@case("refused", "torch.linalg.svdvals spectral-norm clip: _linalg_svd_out checks info on the host")
def h31_svdvals_clip():
    W = torch.randn(6, 6, device=dev)

    @torch.no_grad()
    def step(g):
        W.add_(g)
        s = torch.linalg.svdvals(W)[0]  # HAZARD
        W.div_(torch.clamp(s, min=1.0))
        return W.sum()

    return step, (torch.randn(6, 6, device=dev) * 0.01,)


@case("ok", "WGAN-GP gradient penalty: autograd.grad(create_graph=True), double backward")
def c28_grad_penalty():
    critic = mlp(4, 16, 1)

    def step(real, fake, eps):
        x = (eps * real + (1 - eps) * fake).requires_grad_(True)
        g, = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
        gp = ((g.norm(dim=1) - 1) ** 2).mean()
        loss = critic(fake).mean() - critic(real).mean() + 10 * gp
        loss.backward()
        return loss.detach()

    return step, (torch.randn(8, 4, device=dev), torch.randn(8, 4, device=dev),
                  torch.rand(8, 1, device=dev))


@case("ok", "Q-ensemble with torch.func.stack_module_state + vmap(functional_call)")
def c29_vmap_ensemble():
    import copy

    from torch.func import functional_call, stack_module_state, vmap
    models = [mlp(4, 8, 1) for _ in range(3)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")

    def f(p, b, x):
        return functional_call(base, (p, b), (x,))

    def step(x):
        return vmap(f, in_dims=(0, 0, None))(params, buffers, x).min(0).values

    return step, (torch.randn(8, 4, device=dev),)


@case("ok", "PPO minibatch loop over a device randperm with Python-constant slices")
def c30_randperm_minibatch():
    net = mlp(4, 8, 1)

    def step(obs, ret):
        perm = torch.randperm(obs.shape[0], device=dev)
        tot = torch.zeros((), device=dev)
        for i in range(0, obs.shape[0], 8):
            idx = perm[i:i + 8]
            loss = F.mse_loss(net(obs[idx]).squeeze(-1), ret[idx])
            loss.backward()
            tot += loss.detach()
        return tot

    return step, (torch.randn(32, 4, device=dev), torch.randn(32, device=dev))


@case("refused",
      "GradScaler('cuda') as AMP code writes it: scaler.step reads found_inf with .item() on a "
      "GPU")
def h32_gradscaler_cuda():
    net = mlp(4, 8, 1)
    opt = torch.optim.Adam(net.parameters(), lr=dlr(1e-3), capturable=True, foreach=True)
    scaler = torch.amp.GradScaler("cuda")

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(net(x).squeeze(-1), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)  # HAZARD
        scaler.update()
        return loss.detach()

    return step, (torch.randn(16, 4, device=dev), torch.randn(16, device=dev))
