import threading

import pytest
import torch

from labkit.measure.syncmeter import SyncMeter, count_host_reads


@pytest.mark.parametrize("k", [0, 1, 5])
def test_counts_exactly_k_reads(k):
    x = torch.arange(10.0)

    def reads():
        for i in range(k):
            (x[i] * 2).item()

    n, _ = count_host_reads(reads)
    assert n == k


def test_each_kind_of_read_is_counted():
    x = torch.tensor([1.5, 2.0])
    with SyncMeter() as m:
        x.sum().item()
        x.tolist()
        x.numpy()
        x.cpu()
        bool(x[0] > 0)
        int(x[1])
        float(x[0])
        [0, 1, 2][torch.tensor(1)]
    assert m.counts == {"item": 1, "tolist": 1, "numpy": 1, "cpu": 1, "__bool__": 1,
                        "__int__": 1, "__float__": 1, "__index__": 1}
    assert m.host_reads == 8


def test_device_ops_are_not_reads_and_patch_is_removed():
    x = torch.randn(100)
    original = torch.Tensor.item
    with SyncMeter() as m:
        y = torch.where(x > 0, x, 0.0).cumsum(0)
        y.copy_(x)  # CPU to CPU: no host read
    assert m.host_reads == 0
    assert torch.Tensor.item is original


def test_other_threads_are_not_counted():
    with SyncMeter() as m:
        t = threading.Thread(target=lambda: torch.ones(3).sum().item())
        t.start()
        t.join()
        torch.ones(1).item()
    assert m.host_reads == 1


def test_nested_meters_both_count():
    with SyncMeter() as outer:
        torch.ones(1).item()
        with SyncMeter() as inner:
            torch.ones(1).item()
    assert (outer.host_reads, inner.host_reads) == (2, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_blocking_copy_and_sync_debug_mode():
    x = torch.ones(4, device="cuda")
    host = torch.empty(4)
    with SyncMeter(cuda_debug=True) as m:
        host.copy_(x)
        x.sum().item()
    assert m.counts["copy_"] == 1 and m.counts["item"] == 1
    assert m.cuda_syncs >= 1


def test_call_sites_name_the_line_and_what_torch_did_for_it():
    from labkit.policy import Agent
    from labkit.ppo import PPOConfig
    from labkit.update import Adam

    agent = Agent()
    opt = Adam()(agent.parameters(), PPOConfig(), torch.device("cpu"))
    logits, value = agent(torch.rand(2, 3, 7, 7))
    (logits.sum() + value.sum()).backward()

    def mine(x):
        return x.sum().item()

    with SyncMeter(call_sites=True) as m:
        mine(torch.ones(3))
        opt.step()  # torch's default Adam reads each parameter's step counter
    sites = dict(m.sites)
    [own] = [s for s in sites if "(mine)" in s]
    assert own.startswith("tests/test_syncmeter.py:") and sites[own] == 1
    [adam] = [s for s in sites if "via torch/optim/" in s]
    assert sites[adam] == len(list(agent.parameters())) == m.counts["item"] - 1
    assert SyncMeter().sites is None  # off by default: no stack walks on the hot path


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_the_default_adam_reads_each_step_counter_once_on_every_device(device):
    """torch's foreach Adam (its CUDA default) reads each counter twice; the ladder's Adam steps
    one parameter at a time everywhere, so a chapter's compared count is device-independent."""
    from labkit.policy import Agent
    from labkit.ppo import PPOConfig
    from labkit.update import Adam

    agent = Agent().to(device)
    opt = Adam()(agent.parameters(), PPOConfig(), torch.device(device))
    assert opt.defaults["foreach"] is False
    logits, value = agent(torch.rand(2, 3, 7, 7, device=device))
    (logits.sum() + value.sum()).backward()
    opt.step()
    with SyncMeter() as m:
        opt.step()
    assert m.host_reads == len(list(agent.parameters()))
