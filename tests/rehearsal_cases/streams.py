"""Class 4: explicit synchronisation inside the captured step (profiling code, a wait before
logging). On a GPU each ends the capture."""
from __future__ import annotations

import time

import torch

from . import helpers, nets
from . import sources as src
from .registry import DEVICE, case


@case("synchronize-timed_forward", "stream_sync", "refused", src.DEVICE_SYNC,
      family="cuda_synchronize", variant="quoted")
def _sync():
    policy = helpers.mlp(6, 32, 3).to(DEVICE)
    times: list[float] = []

    def step(obs):
        start = time.perf_counter()
        logits = policy(obs)
        torch.cuda.synchronize()  # HAZARD
        times.append(time.perf_counter() - start)
        return logits

    return step, (torch.randn(16, 6, device=DEVICE),)


@case("synchronize-with_device", "stream_sync", "refused", src.DEVICE_SYNC,
      family="cuda_synchronize", variant="spelling")
def _sync_device():
    critic = helpers.mlp(4, 16, 1).to(DEVICE)

    def step(obs):
        v = critic(obs)
        torch.cuda.synchronize(obs.device)  # HAZARD
        return v

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("synchronize-accelerator_api", "stream_sync", "refused",
      "torch.accelerator.synchronize() is torch.cuda.synchronize on a CUDA machine "
      "(torch/accelerator/__init__.py:246 synchronize -> "
      "torch._C._accelerator_synchronizeDevice, "
      "cudaDeviceSynchronize). " + src.DEVICE_SYNC,
      family="cuda_synchronize", variant="spelling")
def _sync_accelerator():
    def step(x):
        y = x.square().sum(-1)
        torch.accelerator.synchronize()  # HAZARD
        return y

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("synchronize-profiled_policy", "stream_sync", "refused", src.DEVICE_SYNC,
      family="cuda_synchronize", variant="method", hazard=nets.ProfiledPolicy.forward)
def _sync_method():
    return nets.ProfiledPolicy(6, 3).to(DEVICE), (torch.randn(16, 6, device=DEVICE),)


@case("synchronize-helper_stopwatch", "stream_sync", "refused", src.DEVICE_SYNC,
      family="cuda_synchronize", variant="helper", hazard=helpers.stopwatch)
def _sync_helper():
    net = helpers.mlp(4, 16, 2).to(DEVICE)
    spans: list[float] = []

    def step(obs):
        t0 = time.perf_counter()
        out = net(obs)
        spans.append(helpers.stopwatch(obs.device) - t0)
        return out

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("stream_sync-current_stream", "stream_sync", "refused", src.STREAM_SYNC,
      family="stream_synchronize", variant="quoted")
def _stream():
    def step(rewards, values):
        adv = rewards - values
        torch.cuda.current_stream().synchronize()  # HAZARD
        return adv

    return step, (torch.randn(8, device=DEVICE), torch.randn(8, device=DEVICE))


@case("stream_sync-stream_variable", "stream_sync", "refused", src.STREAM_SYNC,
      family="stream_synchronize", variant="spelling")
def _stream_var():
    def step(x):
        stream = torch.cuda.current_stream(x.device)
        y = x.softmax(-1)
        stream.synchronize()  # HAZARD
        return y

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("stream_sync-draining_critic", "stream_sync", "refused", src.STREAM_SYNC,
      family="stream_synchronize", variant="method", hazard=nets.DrainingCritic.forward)
def _stream_method():
    return nets.DrainingCritic(5).to(DEVICE), (torch.randn(8, 5, device=DEVICE),)


@case("stream_sync-helper_drain", "stream_sync", "refused", src.STREAM_SYNC,
      family="stream_synchronize", variant="helper", hazard=helpers.drain_stream)
def _stream_helper():
    def step(logits):
        probs = logits.softmax(-1)
        helpers.drain_stream()
        return probs

    return step, (torch.randn(8, 4, device=DEVICE),)
