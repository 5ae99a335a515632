"""The chapters' generated sentences follow their data: feed a record in which the order
flips and the sentence flips with it."""
from labkit.book.claims import compare_stages, first_to_reach, ranked, update_share


def _row(stage, name, sps, **phases):
    seconds = 32 * 64 / sps
    return {"stage": stage, "name": name, "status": "ok", "n_envs": 32, "n_steps": 64,
            "sps": sps, "phase_ms": phases, "iteration_s_samples": [seconds, seconds * 1.01]}


def test_compare_stages_says_faster_or_slower_from_the_rates_and_names_what_moved():
    a = _row(1, "numpy_vec", 10_000, env=17.0, policy=40.0, update=120.0)
    b = _row(7, "fused_amp", 8_000, env=42.0, policy=41.0, update=148.0)
    slow = compare_stages([a, b], "numpy_vec", "fused_amp")
    assert "0.80x" in slow and "slower than" in slow
    assert "update 148.0 ms against 120.0; env 42.0 ms against 17.0" in slow
    quick = {**b, "sps": 12_500, "iteration_s_samples": [0.16, 0.165]}
    fast = compare_stages([a, quick], "numpy_vec", "fused_amp")
    assert "1.25x" in fast and "faster than" in fast
    overlapping = {**quick, "iteration_s_samples": [0.16, 0.21]}  # a's 0.2048 s inside it
    assert "within this run's spread of it" in compare_stages([a, overlapping], "numpy_vec",
                                                              "fused_amp")
    gone = compare_stages([a, {**b, "status": "skipped: needs CUDA"}], "numpy_vec", "fused_amp")
    assert gone == "No comparison: fused_amp did not run here."


def test_update_share_gives_the_range_and_where_the_update_is_largest():
    rows = [_row(3, "batched_ops", 1, env=10.0, update=90.0),
            _row(7, "fused_amp", 1, env=30.0, update=70.0)]
    text = update_share(rows, ["batched_ops", "fused_amp"])
    assert "70–90% of an iteration" in text and "every one of them" in text
    rows[1]["phase_ms"] = {"env": 80.0, "update": 20.0}
    text = update_share(rows, ["batched_ops", "fused_amp"])
    assert "20–90%" in text and "in batched_ops only" in text


def _curve(*points):
    return {"status": "ok", "curve": [{"steps": s, "wall_s": w, "mean_return": r}
                                      for s, w, r in points]}


def test_first_to_reach_follows_the_wall_clock_not_the_stage_order():
    record = {"meta": {"device_name": "x86_64", "device": "cpu"}, "stages": {
        "numpy_vec": _curve((1000, 10.0, None), (2000, 20.0, 15.0)),
        "fused_amp": _curve((1000, 5.0, 9.0), (2000, 30.0, 16.0)),
        "cuda_graphs": {"status": "skipped: needs CUDA"}}}
    text = first_to_reach(record, 15.0)
    assert text.startswith("On x86_64 (cpu), numpy_vec reached a mean return of 15.0 first: "
                           "after 20 s")
    assert "fused_amp after 30 s (2,000 steps)" in text
    record["stages"]["fused_amp"]["curve"][1]["wall_s"] = 12.0
    assert "fused_amp reached a mean return of 15.0 first: after 12 s" \
        in first_to_reach(record, 15.0)
    assert first_to_reach(record, 99.0) == "On x86_64 (cpu), no stage reached a mean return " \
                                           "of 99.0."
    assert "; numpy_vec did not reach it." in first_to_reach(record, 15.5)


def test_a_record_made_before_the_read_split_shows_dashes_and_says_so(tmp_path):
    """Results recorded before device / host-scalar reads existed (or a future file without
    them) render a dash and a sentence saying so, never 0 or an error."""
    import json

    from labkit.app.report import results_markdown
    from labkit.book.claims import ladder_summary

    row = {"stage": 0, "name": "python_loop", "status": "ok", "n_envs": 32, "n_steps": 64,
           "sps": 100.0, "iteration_s_samples": [1.0, 1.1], "x_vs_stage0": 1.0,
           "x_vs_prev": None, "host_reads_per_iter": 2342, "warmup_s": 0.8,
           "ceiling_sps": 200.0, "frac_of_ceiling": 0.5, "precision": "fp32",
           "phase_ms": {"env": 10.0, "update": 20.0}}
    later = {**row, "stage": 1, "name": "numpy_vec", "sps": 300.0}
    meta = {"device": "cuda", "device_name": "GPU", "profile": "full", "date": "2026-11-25",
            "git_commit": "abc1234", "torch": "2.13"}
    result = {"meta": meta, "config": {"run": {"n_envs": 32, "n_steps": 64}},
              "peak_flops": 1e12, "peak_dtype": "bf16", "ladder": [row, later], "scaling": []}
    (tmp_path / "ladder_cuda_full.json").write_text(json.dumps(result))
    text = results_markdown(tmp_path)
    assert "| 2342 |" not in text and "| \u2014 | \u2014 |" in text
    assert ladder_summary(result)[-1].startswith("This record predates the split")


def test_ranked_names_only_the_stages_every_timed_iteration_separates():
    """A median alone would call stage 1 faster than 3 and 4 here; their timed iterations
    overlap stage 1's, so only 2 (slower throughout) and 5 (faster throughout) are named."""
    def row(stage, seconds):
        return {"stage": stage, "n_envs": 32, "n_steps": 64, "iteration_s_samples": seconds}

    one = row(1, [0.20, 0.21, 0.23])
    others = [row(2, [0.30, 0.33, 0.35]), row(3, [0.19, 0.22, 0.24]), row(4, [0.22, 0.23, 0.26]),
              row(5, [0.10, 0.12, 0.15])]
    assert ranked(one, others) == (
        "stage 1 is faster than stage(s) 2 and slower than stage(s) 5 beyond this run's spread; "
        "within the spread of stage(s) 3, 4: the run cannot tell them apart")
    assert ranked(one, others[1:3]) == (
        "stage 1 is apart from no stage beyond this run's spread; within the spread of "
        "stage(s) 3, 4: the run cannot tell them apart")

