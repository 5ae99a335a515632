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
    assert sum(m.cuda_sync_sites.values()) == m.cuda_syncs
    assert any("test_syncmeter.py" in site for site in m.cuda_sync_sites), m.cuda_sync_sites


def test_call_sites_name_the_line_and_what_torch_did_for_it(cpu):
    from labkit.policy import Agent
    from labkit.ppo import PPOConfig
    from labkit.update import Adam

    agent = Agent()
    opt = Adam()(agent.parameters(), PPOConfig(), cpu)
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


# ------------------------------------------------- device reads apart from host-scalar reads

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))]


def _train_steps(make_opt, device, steps=3, before=0, scheduler=None):
    """A small model trained ``steps`` times under a meter (``before`` steps ahead of it, so
    the optimizer's state exists before the meter starts); the loss read once at the end."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 2)).to(device)
    opt = make_opt(model.parameters())
    sched = scheduler(opt) if scheduler else None
    x = torch.randn(5, 6, device=device)

    def step():
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        return loss

    for _ in range(before):
        step()
    with SyncMeter(call_sites=True) as m:
        for _ in range(steps):
            loss = step()
        loss.item()
    return m, len(list(model.parameters()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("before", [0, 2])
@pytest.mark.parametrize("make_opt, reads_per_param", [
    (lambda p: torch.optim.Adam(p, foreach=False), 1),
    (lambda p: torch.optim.Adam(p, foreach=True), None),  # torch's CUDA default
    (lambda p: torch.optim.AdamW(p), None),
], ids=["adam", "adam-foreach", "adamw"])
def test_an_optimizers_cpu_step_counters_are_host_scalar_reads(make_opt, reads_per_param,
                                                               before, device):
    """torch keeps Adam's step counters on the CPU on every device: their reads never wait for
    a GPU, whether the state was made inside the meter or before it; the loss is a device
    read."""
    m, n_params = _train_steps(make_opt, device, before=before)
    assert m.device_reads == 1 and m.device_counts == {"item": 1}
    assert m.host_scalar_reads >= 3 * n_params
    if reads_per_param:
        assert m.host_scalar_reads == 3 * n_params * reads_per_param
    assert all("via torch/optim/" in site for site in m.sites if site not in m.device_sites)
    [loss_site] = m.device_sites
    assert "(_train_steps)" in loss_site


@pytest.mark.parametrize("device", DEVICES)
def test_sgd_momentum_fused_adam_and_lr_schedulers_read_nothing(device):
    for make_opt, scheduler in [
            (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), None),
            (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
             lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9)),
            (lambda p: torch.optim.Adam(p, fused=True),
             lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda i: 1 - i / 10))]:
        m, _ = _train_steps(make_opt, device, before=1, scheduler=scheduler)
        assert (m.device_reads, m.host_scalar_reads) == (1, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_counters_copies_and_placed_inputs_are_classified_by_where_their_data_came_from(
        device):
    import numpy as np

    weights = torch.ones(4, device=device)
    with SyncMeter() as m:
        counter = torch.tensor(0)  # the user's counter, made on the host
        counter += 1
        counter.item()
        on_device = torch.zeros((), device=device)  # a counter placed on the device
        on_device += 1
        on_device.item()
        literal = torch.zeros(4, device="cpu")  # named the CPU: host even in a GPU run
        literal.tolist()
        (literal + weights.cpu()).sum().item()  # .cpu(): a device read; the sum: host data
        (weights * 2).cpu().numpy()  # one sync for the copy, none for its NumPy view
        obs = torch.from_numpy(np.ones(4, dtype=np.float32))
        obs.sum().item()  # a NumPy array's tensor: host
        obs = obs.to(device)  # the code places it on its device
        (obs * weights).sum().item()
    assert m.counts == {"item": 5, "tolist": 1, "cpu": 2, "numpy": 1}
    assert m.device_counts == {"item": 2, "cpu": 2}
    assert (m.device_reads, m.host_scalar_reads) == (4, 5)


def test_a_tensor_made_before_the_meter_counts_as_a_device_read():
    """The cautious side: the meter did not see where it came from (a false alarm, never a
    sync called free). An optimizer's CPU state is the exception (the first test)."""
    counter = torch.tensor(0)
    with SyncMeter() as m:
        counter += 1
        counter.item()
    assert m.device_reads == 1


def test_a_default_device_moves_unnamed_factories_to_the_device():
    torch.set_default_device("cpu")
    try:
        with SyncMeter() as m:
            torch.zeros(3).sum().item()
    finally:
        torch.set_default_device(None)
    with SyncMeter() as m2:
        torch.zeros(3).sum().item()
    assert (m.device_reads, m2.device_reads) == (1, 0)


def test_compiled_code_stays_compiled_and_its_outputs_are_device_tensors():
    from torch._dynamo.utils import counters

    lin = torch.nn.Linear(3, 2)
    fn = torch.compile(lambda x: lin(x).relu().sum(), backend="eager")
    x = torch.randn(4, 3)
    fn(x)
    graphs = counters["stats"]["unique_graphs"]
    with SyncMeter() as m:
        fn(x).item()
    assert m.device_reads == 1
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile under the meter


def test_the_device_metrics_read_is_a_device_read():
    from labkit.metrics import DeviceEpisodeStats

    stats = DeviceEpisodeStats("cpu")
    done = torch.tensor([True, False, True])
    with SyncMeter() as m:
        stats.update(done, torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5, 6, 7]))
        stats.summary()
    assert m.counts == {"tolist": 1} and m.device_reads == 1


def test_on_a_gpu_run_a_cpu_tensor_is_a_host_read_by_construction():
    """``device="cuda"``: a tensor's own device decides (no data flow), so on a real GPU run a
    CPU tensor is a host read and a CUDA one a device read (``is_device_tensor`` on a meta
    tensor stands for the latter here)."""
    x = torch.ones(3)
    with SyncMeter(device="cuda") as m:
        assert m.is_device_tensor(torch.empty(1, device="meta"))
        (x * 2).sum().item()
    assert (m.host_reads, m.device_reads, m.host_scalar_reads) == (1, 0, 1)


@pytest.mark.slow  # builds and compiles stages 6 and 7
@pytest.mark.parametrize("foreach", [False, True])
def test_stage_reads_split_as_on_a_gpu(foreach, tiny_run):
    """Stage 6 reads each Adam counter (host-scalar) and the metrics once (device); stage 7
    only the metrics (the issue's N=8, T=16 measurement)."""
    from labkit.stages import STAGES, Pipeline

    split = {}
    for index in (6, 7):
        with Pipeline(STAGES[index], tiny_run, "cpu") as p:
            if foreach and index == 6:
                for group in p.optimizer.param_groups:
                    group["foreach"] = True
            with SyncMeter(device=p.device) as m:
                p.learn(p.rollout())
        split[index] = (m.device_reads, m.host_scalar_reads)
    n_params, steps = 10, 16
    assert split[7] == (1, 0)
    assert split[6][0] == 1 and split[6][1] == n_params * steps * (2 if foreach else 1) \
        or (foreach and split[6][1] >= n_params * steps)


def test_launches_per_optimizer_step_fused_fewest_per_parameter_growing():
    """What a GPU would launch per Adam step: per-parameter Adam grows with the parameters,
    foreach and fused do not, fused launches fewest; the CPU step counters launch nothing."""
    from labkit.measure.profiling import launches

    def per_step(n_layers, **kw):
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n_layers)])
        opt = torch.optim.Adam(model.parameters(), **kw)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        return sum(launches(opt.step).values())

    loop3, foreach3, fused3, loop6, foreach6, fused6 = (
        per_step(n, **kw) for n in (3, 6)
        for kw in ({"foreach": False}, {"foreach": True}, {"fused": True}))
    assert fused3 < foreach3 < loop3 and fused6 < foreach6 < loop6
    assert loop6 == 2 * loop3 and foreach6 == foreach3 and fused6 == fused3


@pytest.mark.parametrize("device", DEVICES)
def test_a_parameters_host_copy_is_host_data_and_the_parameter_stays_on_the_device(device):
    w = torch.nn.Parameter(torch.ones(4, device=device))
    with SyncMeter() as m:
        w.cpu().sum().item()  # one copy to the host (a sync), then host data
        (w * 2).sum().item()  # the parameter itself: still a device tensor
    assert (m.device_counts, m.host_scalar_counts) == ({"cpu": 1, "item": 1}, {"item": 1})


def test_an_op_that_returns_nothing_launches_on_its_device_inputs():
    from labkit.measure.profiling import launches

    on_device = torch.ones(3)  # made before: a device tensor, the cautious side
    assert launches(lambda: torch._assert_async((on_device > 0).all())) == {
        "gt": 1, "all": 1, "_assert_async": 1}
    assert launches(lambda: torch._assert_async(torch.tensor(True))) == {}


@pytest.mark.inductor
@pytest.mark.slow
def test_inductors_own_reads_while_it_compiles_a_backward_lazily_are_not_counted():
    """AOT autograd compiles a backward at the first ``backward()``, outside dynamo, and
    inductor reads there (it rounds a scalar compared with a bf16 tensor with ``.item()``:
    ReLU's backward under bf16 autocast): compile-time work, not the code's. Counted once,
    this read made a chapter's compared output depend on whether inductor's cache was warm."""
    import torch._inductor.config as inductor_config

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    @torch.compile
    def loss(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return net(x).float().mean()

    with inductor_config.patch(fx_graph_cache=False), SyncMeter(call_sites=True) as m:
        loss(torch.randn(4, 8)).backward()  # compiles the forward, then the backward
        loss(torch.randn(4, 8)).sum().item()  # the code's own read: counted
    assert m.host_reads == 1 and all("lowering" not in site for site in m.sites), m.sites


@pytest.mark.inductor
@pytest.mark.slow
def test_a_compiled_region_launches_its_generated_kernels_not_zero():
    """An aten-level count sees only what compiled code calls out to; the launch count adds
    the kernels inductor generated (here one fused kernel for four elementwise ops and a sum,
    which eagerly launch five)."""
    from labkit.measure.profiling import launches

    def f(x):
        return ((x * 2 + 1).relu() * 3).sum()

    compiled = torch.compile(f)
    x = torch.randn(64)
    compiled(x)  # compiles
    eager, fused = launches(lambda: f(x)), launches(lambda: compiled(x))
    assert sum(eager.values()) == 5, eager
    assert sum(fused.values()) == 1 and next(iter(fused)).startswith("inductor::"), fused


def test_only_cudas_sync_reports_count_as_syncs_at_the_callers_line():
    """Under the CUDA sync debug mode the meter counts c10's "called a synchronizing CUDA
    operation" at the first frame outside torch, and passes any other warning on: torch's
    one-time note that the debug mode is a prototype (it says "synchronizing" too) is not a
    sync (the meter ignores it while the debug mode is on: torch's, not the reader's)."""
    import warnings

    from labkit.measure import syncmeter

    m = SyncMeter()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        m._show_other, warnings.showwarning = warnings.showwarning, m._cuda_warning
        warnings.warn(syncmeter.CUDA_DEBUG_NOTE + " and does not yet detect all "
                      "synchronizing operations", stacklevel=1)
        warnings.warn(syncmeter.CUDA_SYNC_WARNING, stacklevel=1)
    assert m.cuda_syncs == 1
    (site,) = m.cuda_sync_sites
    assert "test_syncmeter.py" in site and "(test_only_cudas_sync_reports" in site
    assert ["prototype feature" in str(w.message) for w in shown] == [True]


def test_a_cuda_sync_is_counted_by_every_enclosing_meter():
    import warnings

    from labkit.measure import syncmeter

    outer, inner = SyncMeter(), SyncMeter()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        outer._show_other, warnings.showwarning = warnings.showwarning, outer._cuda_warning
        inner._show_other, warnings.showwarning = warnings.showwarning, inner._cuda_warning
        warnings.warn(syncmeter.CUDA_SYNC_WARNING, stacklevel=1)
        warnings.warn("something else", stacklevel=1)
    assert (outer.cuda_syncs, inner.cuda_syncs) == (1, 1)
    assert list(outer.cuda_sync_sites) == list(inner.cuda_sync_sites)
    assert "test_syncmeter.py" in next(iter(outer.cuda_sync_sites))
    assert [str(w.message) for w in shown] == ["something else"]
