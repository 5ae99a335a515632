"""The chapters' helpers: labkit's own source, what a stage changes, profiler tables."""
import pytest

from labkit.book.show import changed_slots, diff, reads_table, say, source, stage_table
from labkit.capture import warmup
from labkit.config import RunConfig
from labkit.measure.profiling import op_counts, profile_calls, top_ops
from labkit.stages import STAGES, Pipeline


def test_source_and_diff_come_from_the_package():
    text = source(STAGES[4].logger)
    assert text.startswith("# labkit/logging.py: AsyncLogger\nclass AsyncLogger")
    d = diff(STAGES[3].logger, STAGES[4].logger)
    assert d.startswith("--- labkit/logging.py: SyncLogger\n+++ labkit/logging.py: AsyncLogger")
    assert "\n-class SyncLogger" in d and "\n+class AsyncLogger" in d


def test_a_brief_source_is_the_signature_and_docstring_and_says_what_it_left_out():
    from labkit.capture import CapturedStep
    from labkit.timing import amdahl_sps

    full, brief = source(CapturedStep), source(CapturedStep, brief=True)
    head, _, rest = full.partition('    """\n')
    assert brief.startswith(head + '    """\n')
    left = len(full.splitlines()) - len(brief.splitlines()) + 1
    assert brief.endswith(f"    ...  # {left} more lines in labkit/capture.py\n")
    assert "def __call__" in rest and "def __call__" not in brief
    text = source(amdahl_sps, brief=True)
    assert text.splitlines()[-1].startswith("    ...  # ") and "return" not in text


def test_changed_slots_and_stage_table():
    assert set(changed_slots(STAGES[6], STAGES[7])) == {"optimizer", "precision",
                                                        "rollout_executor", "update_executor"}
    assert set(changed_slots(STAGES[3], STAGES[4])) == {"logger"}
    table = stage_table(list(STAGES)).splitlines()
    starts = [line.split()[0] for line in table[1:] if not line.startswith(" ")]
    assert starts == [str(s.index) for s in STAGES]  # one entry per stage, in order
    assert max(map(len, table)) <= 92  # wrapped: a page never breaks a name
    assert "Graphed(Compiled(), needs bf16)" in table[-1]
    # after the first stage, an entry names exactly the slots its lesson changes
    at = next(i for i, line in enumerate(table) if line.startswith("7 "))
    seven = " ".join([table[at].split(None, 2)[2], table[at + 1].strip()])
    assert seven == ("optimizer FusedAdam(); precision Amp(); rollout_executor "
                     "CompiledIfFaster(); update_executor CompiledIfFaster()")
    assert all(slot in "".join(table[1:4]) for slot in STAGES[0].components())


def test_reads_table_sorts_and_divides():
    text = reads_table({"a.py:1 (f)": 4, "b.py:2 (g)": 64}, per=2)
    assert text.splitlines()[1:] == ["          32  b.py:2 (g)", "           2  a.py:1 (f)"]


@pytest.mark.slow
def test_profiler_tables_count_ops(cpu):
    with Pipeline(3, RunConfig(n_envs=8, n_steps=8), "cpu") as p:
        warmup(p)
        prof = profile_calls(p.iteration, p.device, calls=2)
    counts = op_counts(prof)
    # 4 epochs x 4 minibatches x 2 iterations of one conv-conv-linear forward + backward
    assert counts["aten::convolution_backward"] == 2 * 16 * 2
    table = top_ops(prof, cpu, n=5, per=2).splitlines()
    assert table[0].split()[:2] == ["op", "calls"] and len(table) == 6


@pytest.mark.parametrize("call, name", [
    (lambda p, s: p.ladder_bars({}), "ladder_bars"),
    (lambda p, s: p.ladder_bars({"ladder": [], "meta": {}}), "ladder_bars"),
    (lambda p, s: p.ladder_bars([]), "ladder_bars"),
    (lambda p, s: p.ladder_bars({"ladder": [{"foo": 1}]}), "ladder_bars"),
    (lambda p, s: p.scaling_lines({}), "scaling_lines"),
    (lambda p, s: p.scaling_lines({"scaling": [], "meta": {}}), "scaling_lines"),
    (lambda p, s: p.scaling_lines({"scaling": [{"foo": 1}]}), "scaling_lines"),
    (lambda p, s: p.learning_curves({"a": [{}]}), "learning_curves"),
    (lambda p, s: s.rows_table([{}]), "rows_table"),
    (lambda p, s: s.stage_table([]), "stage_table"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_helpers_name_what_is_missing_in_empty_or_foreign_input(call, name):
    import matplotlib
    matplotlib.use("Agg")
    from labkit.book import plots, show
    with pytest.raises(ValueError, match=rf"^{name} takes "):
        call(plots, show)


def test_provenance_names_device_torch_commit_date_and_the_method():
    import torch

    from labkit.book.show import provenance
    from labkit.config import BenchConfig
    from labkit.device import git_commit

    line = provenance(torch.device("cpu"))
    assert line.startswith("measured on ") and f"torch {torch.__version__}" in line
    assert f"at commit {git_commit()}, 20" in line and "\n" not in line
    lines = provenance(torch.device("cpu"), BenchConfig(iterations=4)).splitlines()
    method = " ".join(line.strip() for line in lines[1:])
    assert method.startswith("method: ") and "then 4 rounds" in method
    assert max(map(len, lines[1:])) <= 92


def test_ladder_bar_labels_clear_the_error_bars_and_a_skipped_note_stays_inside():
    import matplotlib

    matplotlib.use("Agg")
    from labkit.book.plots import ladder_bars

    rows = [{"stage": 0, "name": "a", "n_envs": 32, "status": "ok", "sps": 100.0,
             "sps_spread": [90.0, 100.0, 130.0]},
            {"stage": 1, "name": "b", "n_envs": 32, "status": "ok", "sps": 1000.0,
             "sps_spread": [950.0, 1000.0, 1010.0]},
            {"stage": 8, "name": "c", "n_envs": 32, "status": "skipped: needs CUDA"}]
    ax = ladder_bars({"ladder": rows, "meta": {"device_name": "x", "torch": "t"}})
    labels = {t.get_text(): t for t in ax.texts}
    assert labels["100"].xy[1] == 130.0 and labels["1,000"].xy[1] == 1010.0
    assert ax.get_ylim()[1] > 1010.0 * 1.3  # headroom above the highest label
    ax.figure.canvas.draw()
    note = labels["skipped: needs CUDA"].get_window_extent()
    box = ax.get_window_extent()
    assert box.x0 <= note.x0 and note.x1 <= box.x1 and box.y0 <= note.y0 and note.y1 <= box.y1


def test_say_wraps_a_computed_sentence_to_the_page_and_keeps_its_words(capsys):
    sentence = "stage 4 ran at 1.06x stage 3's median env steps/s (2,864 vs 2,709); " * 5
    say("* " + sentence, "\nshort")
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 96 and lines[-1] == "short"
    assert all(line.startswith("  ") for line in lines[1:-1])  # under the bullet
    assert " ".join(line.strip() for line in lines[:-1]) == ("* " + sentence).strip()
