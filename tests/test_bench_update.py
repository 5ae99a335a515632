"""``python -m labkit bench-update``: the PPO update's minibatch step eager and compiled, in
fp32 and bf16, timed in interleaved rounds (what decides whether compile and bf16 pay)."""
import json

import pytest

from labkit.app.cli import main
from labkit.measure.updatebench import CPU_VARIANTS, FORMULATIONS, VARIANTS, model_products


@pytest.mark.slow
def test_every_variant_is_timed_at_every_size_and_written(tmp_path, capsys, monkeypatch):
    from labkit.measure import updatebench

    made, stepped = updatebench._optimizer_step, []

    def counted(*args):
        step = made(*args)
        return lambda: (stepped.append(1), step())

    monkeypatch.setattr(updatebench, "_optimizer_step", counted)
    assert main(["bench-update", "--device", "cpu", "--sizes", "64:1", "128", "--rounds", "2",
                 "--out", str(tmp_path)]) == 0
    # every floor's call ends with the optimizer's step: 2 sizes x 6 floors x (2 warm + 2 timed)
    assert len(stepped) == 2 * 2 * len(FORMULATIONS) * (2 + 2)
    result = json.loads((tmp_path / "bench_update_cpu.json").read_text())
    rows = result["rows"]
    assert [(r["minibatch"], r["executor"], r["precision"], r["conv_math"]) for r in rows] == [
        (n, *v) for n in (64, 128) for v in VARIANTS + CPU_VARIANTS]
    assert all(r["threads"] == 1 and len(r["samples_ms"]) == 2 for r in rows)
    assert all(r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["median_ms"] > 0
               for r in rows)
    assert [r["x_eager_fp32"] for r in rows if r["executor"] == "eager"
            and r["precision"] == "fp32" and r["conv_math"] == "conv2d"] == [1.0, 1.0]
    # the share of the matmul peak: the model's FLOPs per second over the dtype's peak
    from labkit.policy import flops_per_sample
    for r in rows:
        assert r["model_flops"] == flops_per_sample()["train"] * r["minibatch"]
        assert r["frac_of_peak"] == pytest.approx(
            r["model_flops"] / (r["median_ms"] / 1e3) / r["peak_flops"])
        # a rate in FLOP/s, not a unit slip (ms or GFLOP would be 1e3-1e9 off): a CPU without
        # bf16 instructions, on 1 thread of a busy host, measured its bf16 peak at 0.89 GFLOP/s
        assert 0 < r["frac_of_peak"] and r["peak_flops"] > 1e8
    # the floors: the model's products, then the fused optimizer step, per formulation and
    # precision, after the rows
    floors = result["floors"]
    assert [(r["minibatch"], r["formulation"], r["precision"]) for r in floors] == [
        (n, form, prec) for n in (64, 128) for form in FORMULATIONS for prec in ("fp32", "bf16")]
    for r in floors:
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and len(r["samples_ms"]) == 2
        assert r["max_frac_of_peak"] == pytest.approx(
            r["model_flops"] / (r["median_ms"] / 1e3) / r["peak_flops"])
    out = capsys.readouterr().out
    assert "% peak at most" in out and "im2col bf16" in out and "rows fp32" in out
    assert "compiled bf16 matmul" in out and "compiled/256b fp32 conv2d" in out
    assert "% peak" in out
    assert out.rstrip().endswith("bench_update_cpu.json")
    # its compiles are dropped: left, they counted towards dynamo's recompile limit, and the
    # next fullgraph compile of the loss in the process (a stage's, say) failed
    import torch

    from labkit.measure.updatebench import _steps
    from labkit.ppo import PPOConfig
    _steps(96, torch.device("cpu"), PPOConfig())["compiled", "bf16", "conv2d"]()


@pytest.mark.parametrize("sizes", [["4096:x"], ["0"], ["3:-2"], ["64:0"]])
def test_a_bad_size_is_one_line_and_exit_2(sizes, capsys):
    with pytest.raises(SystemExit) as exc:  # argparse's usage error, one line (cli._Parser)
        main(["bench-update", "--sizes", *sizes])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "MINIBATCH:THREADS" in err and err.count("\n") == 1


@pytest.mark.parametrize("view", [5, 7, 9])
def test_the_floors_products_are_the_models(view):
    """im2col's products do exactly the model's multiply-adds (labkit.policy's count); the
    dense matmuls' do more, by the zeros outside each window, and the row-banded ones fewer
    than those (a band of 3 input rows, not all V)."""
    from labkit.policy import flops_per_sample

    products = model_products(10, view)
    assert tuple(products) == FORMULATIONS
    forward = {form: sum(2 * m * k * n for m, k, n in p) for form, p in products.items()}
    assert forward["im2col"] == 10 * flops_per_sample(view)["forward"]
    assert forward["matmul"] > forward["rows"] > forward["im2col"]
    for form in FORMULATIONS:  # the linear layer and the heads
        assert products[form][2:] == products["im2col"][2:]


def _product_of(form: str, conv, x):
    """``conv`` (unpadded 3x3) of ``x`` (B, C, V, V) computed as ``form``'s one matrix product,
    each side's matrix built by convolving a basis (the test's own reference layout):
    returns the (B, O, V', V') result and the product's (M, K, N)."""
    import torch
    import torch.nn.functional as F

    b, c, v, _ = x.shape
    o, s = conv.out_channels, v - 2
    w, bias = conv.weight, conv.bias
    if form == "matmul":
        basis = torch.eye(c * v * v, dtype=x.dtype).view(-1, c, v, v)
        dense = F.conv2d(basis, w).flatten(1)                          # (C*V*V, O*V'*V')
        a = x.flatten(1)
        out = (a @ dense).view(b, o, s, s) + bias.view(1, -1, 1, 1)
    elif form == "im2col":
        a = F.unfold(x, 3).transpose(1, 2).reshape(b * s * s, c * 9)   # (B*V'*V', C*9)
        dense = w.flatten(1).t()                                       # (C*9, O)
        out = (a @ dense).view(b, s, s, o).permute(0, 3, 1, 2) + bias.view(1, -1, 1, 1)
    else:  # rows: output row y from input rows y..y+2, the weight as a band
        basis = torch.eye(c * 3 * v, dtype=x.dtype).view(-1, c, 3, v)
        dense = F.conv2d(basis, w).flatten(1)                          # (C*3*V, O*V')
        a = x.unfold(2, 3, 1).permute(0, 2, 1, 4, 3).reshape(b * s, c * 3 * v)
        out = (a @ dense).view(b, s, o, s).permute(0, 2, 1, 3) + bias.view(1, -1, 1, 1)
    return out, (a.shape[0], a.shape[1], dense.shape[1])


@pytest.mark.parametrize("form", FORMULATIONS)
@pytest.mark.parametrize("view", [5, 7])
def test_each_formulations_products_compute_the_convolutions(form, view):
    """Each layout's (M, K, N) is that of a real computation of the agent's convolutions:
    laid out that way, one product per convolution gives what ``nn.Conv2d`` gives."""
    import torch

    from labkit.policy import ConvBody

    torch.manual_seed(0)
    body, n = ConvBody(view).double(), 4
    x = torch.rand(n, 3, view, view, dtype=torch.float64)
    shapes = []
    with torch.no_grad():
        for conv in (body[0], body[2]):
            out, shape = _product_of(form, conv, x)
            torch.testing.assert_close(out, conv(x), rtol=1e-12, atol=1e-12)
            shapes.append(shape)
            x = torch.relu(out)
    assert shapes == model_products(n, view)[form][:2]


def test_the_floor_ends_with_stage_7s_optimizer_step():
    """The floor's call runs the products and then one fused Adam step (after the fused grad
    clip) on the reference agent's parameters: what every minibatch step must also do."""
    import torch

    from labkit.measure.updatebench import _optimizer_step, _products_pass
    from labkit.ppo import PPOConfig

    cfg = PPOConfig()
    step = _optimizer_step(torch.device("cpu"), cfg)
    (optimizer,) = {cell.cell_contents for cell in step.__closure__
                    if isinstance(cell.cell_contents, torch.optim.Adam)}
    params = optimizer.param_groups[0]["params"]
    before = [p.detach().clone() for p in params]
    assert torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])) > 10 * (
        cfg.max_grad_norm)  # random gradients, far above the clip
    _products_pass([(4, 3, 2)], torch.float32, torch.device("cpu"), step)()
    assert optimizer.defaults["fused"] and all(
        int(optimizer.state[p]["step"]) == 1 for p in params)
    assert all(not torch.equal(p, b) for p, b in zip(params, before))
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    assert clipped == pytest.approx(cfg.max_grad_norm, rel=1e-4)  # clipped before the step
