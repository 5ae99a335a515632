"""The doctor wing's one vocabulary: every instrument reports a ``labkit.doctor.kinds.Finding``
of a kind the one table names, with the chapter that teaches its fix."""
import re
from pathlib import Path

import pytest
import torch

import labkit
from labkit.doctor import Finding, kinds, rehearsal, watch
from labkit.doctor.kinds import KINDS

NOTEBOOKS = {p.stem for p in (Path(__file__).parent.parent / "notebooks").glob("*.ipynb")}


def test_every_kind_names_a_chapter_that_exists_and_says_what_it_means():
    for name, kind in KINDS.items():
        chapter = re.match(r"\d\d_\w+", kind.chapter)
        assert chapter and chapter.group() in NOTEBOOKS, (name, kind.chapter)
        assert kind.means and not kind.means.endswith("."), name


def test_a_kind_the_table_does_not_name_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"Finding.kind must be one of device_read, .*; got "
                                         r"'host_read'"):
        Finding("host_read", "here", "a read")


def test_a_finding_without_chapter_or_fix_gets_its_kinds():
    f = Finding("no_device", "x.py:3 (f)", "a factory")
    assert (f.chapter, f.fix) == (KINDS["no_device"].chapter, KINDS["no_device"].fix)
    assert str(f) == "[no_device] x.py:3 (f): a factory"
    mine = Finding("no_device", "x.py:3 (f)", "a factory", chapter="03_x", fix="do y")
    assert (mine.chapter, mine.fix) == ("03_x", "do y")
    # a rehearsal kind's fix is in what it means
    assert Finding("seed", "x.py:3 (f)", "s").fix == KINDS["seed"].means


def test_watch_and_the_rehearsal_report_the_one_finding_type():
    assert watch.Finding is rehearsal.Finding is kinds.Finding is labkit.doctor.Finding
    with labkit.watch() as w:
        for _ in range(2):
            torch.zeros(3).sum().item()
            w.step()
    found = w.report().findings
    assert found and all(type(f) is Finding for f in found)
    assert {f.kind for f in found} >= {"no_device"}
    back = watch.WatchReport.from_dict(w.report().to_dict())
    assert back.findings == found

    def step(x):
        return x * float(x.sum())

    report = rehearsal.rehearse(step, torch.ones(3))
    assert not report.ok and all(type(p) is Finding for p in report.problems)
    assert {p.kind for p in report.problems} == {"device_read"}
    assert all(p.chapter == KINDS[p.kind].chapter for p in report.problems)


def test_the_doctors_report_names_a_notebook_that_exists_for_every_kind():
    from labkit.doctor import Report

    report = Report("7 fused_amp", "cpu", 8, 8, 1,
                    findings=[Finding(kind, "here", "a finding") for kind in KINDS])
    read = re.findall(r"read: (notebooks/\S+\.ipynb)", report.format())
    root = Path(__file__).parent.parent
    assert len(read) == len(KINDS) and all((root / path).is_file() for path in read), read
