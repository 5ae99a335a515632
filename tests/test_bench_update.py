"""``python -m labkit bench-update``: the PPO update's minibatch step eager and compiled, in
fp32 and bf16, timed in interleaved rounds (what decides whether compile and bf16 pay)."""
import json

import pytest

from labkit.app.cli import main
from labkit.measure.updatebench import CPU_VARIANTS, FORMULATIONS, VARIANTS, model_products


@pytest.mark.slow
def test_every_variant_is_timed_at_every_size_and_written(tmp_path, capsys):
    assert main(["bench-update", "--device", "cpu", "--sizes", "64:1", "128", "--rounds", "2",
                 "--out", str(tmp_path)]) == 0
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
        assert 0 < r["frac_of_peak"] and r["peak_flops"] > 1e9
    # the floors: the model's products alone, per formulation and precision, after the rows
    floors = result["floors"]
    assert [(r["minibatch"], r["formulation"], r["precision"]) for r in floors] == [
        (n, form, prec) for n in (64, 128) for form in FORMULATIONS for prec in ("fp32", "bf16")]
    for r in floors:
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and len(r["samples_ms"]) == 2
        assert r["max_frac_of_peak"] == pytest.approx(
            r["model_flops"] / (r["median_ms"] / 1e3) / r["peak_flops"])
    out = capsys.readouterr().out
    assert "% peak at most" in out and "im2col bf16" in out
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
    dense matmuls' do more, by the zeros outside each window."""
    from labkit.policy import flops_per_sample

    products = model_products(10, view)
    forward = {form: sum(2 * m * k * n for m, k, n in p) for form, p in products.items()}
    assert forward["im2col"] == 10 * flops_per_sample(view)["forward"]
    assert forward["matmul"] > forward["im2col"]
    assert products["matmul"][2:] == products["im2col"][2:]  # the linear layer and the heads
