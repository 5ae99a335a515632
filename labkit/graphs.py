"""Stage 8: replay the rollout step and the minibatch update as CUDA graphs.

A CUDA graph records a sequence of kernels once and replays it with one launch, removing the
Python and launch overhead of hundreds of small kernels. What makes it legal here:
static shapes, state updated in place (env, metrics, storage written with ``index_copy_`` at a
device-side step counter), a capturable Adam whose LR is a device tensor, and sampling from a
generator registered with the graph. Warmup runs on a side stream (as torch's docs require),
then model/optimizer/env state is restored in place before capture.
"""
from __future__ import annotations

from dataclasses import fields

import torch

from .compile import restore_, snapshot
from .ppo import Batch
from .rollout import DeviceCollector

WARMUP_CALLS = 3


def _side_stream_warmup(fn, calls: int = WARMUP_CALLS) -> None:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


class GraphedStep:
    """Wrap ``step(mb) -> stats`` (forward, backward, clip, optimizer step on one minibatch):
    the first call captures it on static input buffers; later calls copy the minibatch in and
    replay."""

    def __init__(self, step, agent: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.step, self.agent, self.optimizer = step, agent, optimizer
        self.graph: torch.cuda.CUDAGraph | None = None

    def _capture(self, mb: Batch) -> None:
        self.static = Batch(**{f.name: getattr(mb, f.name).clone() for f in fields(mb)})
        snap = snapshot(self.agent, self.optimizer)
        _side_stream_warmup(lambda: self.step(self.static))
        restore_(self.agent, self.optimizer, snap)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.step(self.static)

    def __call__(self, mb: Batch) -> dict[str, torch.Tensor]:
        if self.graph is None:
            self._capture(mb)
        for f in fields(mb):
            getattr(self.static, f.name).copy_(getattr(mb, f.name))
        self.graph.replay()
        return {k: v.clone() for k, v in self.out.items()}  # the next replay overwrites out


class GraphedCollector(DeviceCollector):
    """The whole rollout step (policy, env step, storage writes, metrics) as one graph.

    ``body()`` is written capture-safe; with ``capture=False`` (CPU tests) it runs eagerly and
    must give exactly what ``DeviceCollector`` gives.
    """

    def __init__(self, *args, generator: torch.Generator | None = None, capture: bool = True,
                 **kwargs) -> None:
        self.generator, self.capture, self.graph = generator, capture, None
        super().__init__(*args, **kwargs)

    def reset(self) -> None:
        obs = self.env.reset(seed=self.seed)[0]
        if not hasattr(self, "obs"):
            self.obs = obs.clone()
            self.done = torch.zeros(self.n_envs, device=self.device)
            self.t = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.reward_mean = torch.zeros((), device=self.device)
        self.obs.copy_(obs)
        self.done.zero_()
        self.t.zero_()

    def body(self) -> None:
        s, t = self.storage, self.t
        action, logprob, value = self.act(self.obs)
        for buf, x in ((s.obs, self.obs), (s.actions, action), (s.logprobs, logprob),
                       (s.values, value), (s.dones, self.done)):
            buf.index_copy_(0, t, x.unsqueeze(0))
        obs, reward, term, trunc, info = self.env.step(action)
        done = term | trunc
        s.rewards.index_copy_(0, t, reward.unsqueeze(0))
        self.obs.copy_(obs)
        self.done.copy_(done)
        self.metrics.update(done, info["episode_return"], info["episode_length"])
        self.reward_mean.copy_(reward.mean())
        self.t.add_(1).remainder_(self.n_steps)

    def _capture(self) -> None:
        # The warmup calls really run: save everything they touch and put it back in place.
        env_state = self.env.state_dict()
        gen_state = self.generator.get_state() if self.generator is not None else None
        mine = (*self.storage.tensors().values(), self.obs, self.done, self.t)
        saved = [x.clone() for x in mine]
        _side_stream_warmup(self.body)
        self.env.load_state_dict(env_state)
        if gen_state is not None:
            self.generator.set_state(gen_state)
        for x, v in zip(mine, saved):
            x.copy_(v)
        self.metrics.reset()  # captured at an iteration's first step, when it holds nothing
        self.graph = torch.cuda.CUDAGraph()
        if self.generator is not None:
            self.graph.register_generator_state(self.generator)
        with torch.cuda.graph(self.graph):
            self.body()

    def step(self, t: int) -> None:
        if not self.capture:
            self.body()
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
        self.logger.log(self.global_step, reward=self.reward_mean)
