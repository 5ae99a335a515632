"""Sentences computed from a record: what a chapter (or the README) says about its numbers,
written from the numbers themselves, so a re-record that changes the order changes the words.

Each function takes rows or a record as ``labkit.measure.bench`` and ``labkit.app.record``
write them and returns one or two plain sentences; nothing here measures anything.
:func:`versus` and :func:`phase_moved` claim a difference only where the rows' timed
iterations resolve it: the two ranges (fastest to slowest iteration) do not overlap;
otherwise it is within this run's spread."""
from __future__ import annotations

from collections.abc import Iterable


def _share(row: dict, phase: str) -> float | None:
    phases = row.get("phase_ms") or {}
    total = sum(phases.values())
    return phases[phase] / total if total and phase in phases else None


def _ok(rows: Iterable[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in rows if r.get("status", "ok") == "ok"}


def _pct(value: float) -> str:
    return f"{100 * value:.0f}%"


def compare_stages(rows: list[dict], before: str, after: str, phases: int = 2) -> str:
    """How stage ``after`` compares with stage ``before`` in one run's ``rows``: the ratio of
    their rates, and the ``phases`` phases whose time changed most, each with both times."""
    ok = _ok(rows)
    if before not in ok or after not in ok:
        missing = [n for n in (before, after) if n not in ok]
        return f"No comparison: {', '.join(missing)} did not run here."
    a, b = ok[before], ok[after]
    ratio = b["sps"] / a["sps"]
    word = "faster than" if ratio > 1 else "slower than" if ratio < 1 else "as fast as"
    moved = sorted(set(a["phase_ms"]) & set(b["phase_ms"]),
                   key=lambda k: -abs(b["phase_ms"][k] - a["phase_ms"][k]))[:phases]
    parts = [f"{k} {b['phase_ms'][k]:.1f} ms against {a['phase_ms'][k]:.1f}" for k in moved]
    if _apart(_span(_iterations(b)), _span(_iterations(a))) == 0:
        word = "within this run's spread of"  # their timed iterations overlap
    return (f"Stage {b['stage']} {after} runs at {ratio:.2f}x stage {a['stage']} {before} "
            f"({word} it: {b['sps']:,.0f} vs {a['sps']:,.0f} env steps/s at N={b['n_envs']}); "
            f"the phases that moved most: {'; '.join(parts)}.")


def update_share(rows: list[dict], names: Iterable[str]) -> str:
    """What share of an iteration the update takes in the stages ``names`` (their range), and
    in which of them it is the largest phase."""
    ok = _ok(rows)
    shares = {n: _share(ok[n], "update") for n in names if n in ok}
    shares = {n: s for n, s in shares.items() if s is not None}
    if not shares:
        return "No phase breakdown of these stages here."
    low, high = min(shares.values()), max(shares.values())
    largest = [n for n in shares
               if max(ok[n]["phase_ms"], key=ok[n]["phase_ms"].get) == "update"]
    span = _pct(low) if round(100 * low) == round(100 * high) \
        else f"{100 * low:.0f}–{_pct(high)}"
    if len(largest) == len(shares):
        where = "the largest phase in every one of them"
    elif largest:
        where = f"the largest phase in {', '.join(largest)} only"
    else:
        where = "the largest phase in none of them"
    return (f"At N={next(iter(ok.values()))['n_envs']} the update takes {span} of an iteration "
            f"in {', '.join(shares)}: {where}.")


def first_to_reach(record: dict, target: float, what: str = "") -> str:
    """Which stage of a learning ``record`` (``record``'s ``learning_*.json``) first reached a
    mean return of ``target`` in wall-clock time, and when each reached it (env steps and
    seconds), on the record's device; ``what`` names the target ("half the oracle's")."""
    meta = record.get("meta", {})
    device = f"{meta.get('device_name', '?')} ({meta.get('device', '?')})"
    reached, never = {}, []
    for name, stage in record.get("stages", {}).items():
        if stage.get("status", "ok") != "ok" or "curve" not in stage:
            continue
        hit = next((p for p in stage["curve"]
                    if p.get("mean_return") is not None and p["mean_return"] >= target), None)
        if hit is None:
            never.append(name)
        else:
            reached[name] = hit
    label = f"a mean return of {target:.1f}" + (f" ({what})" if what else "")
    if not reached:
        return f"On {device}, no stage reached {label}."
    order = sorted(reached, key=lambda n: reached[n]["wall_s"])
    first, rest = order[0], order[1:]
    text = (f"On {device}, {first} reached {label} first: after {reached[first]['wall_s']:.0f} s "
            f"and {reached[first]['steps']:,} env steps")
    if rest:
        text += "; " + ", ".join(f"{n} after {reached[n]['wall_s']:.0f} s "
                                 f"({reached[n]['steps']:,} steps)" for n in rest)
    if never:
        text += f"; {', '.join(never)} did not reach it"
    return text + "."


def reads_story(rows: list[dict]) -> str:
    """Device reads (syncs on a GPU) per iteration from the first stage that ran to the last,
    and the host-scalar reads beside them; a record made before the split says so."""
    ok = list(_ok(rows).values())
    if not ok:
        return "No stage ran."
    first, last = ok[0], ok[-1]
    if any(r.get("device_reads_per_iter") is None for r in (first, last)):
        return ("This record predates the split of host reads into device reads and "
                "host-scalar reads: record it again to see it.")
    return (f"Device reads (each a sync on a GPU) per iteration: "
            f"{first['device_reads_per_iter']:g} in stage {first['stage']} {first['name']}, "
            f"{last['device_reads_per_iter']:g} in stage {last['stage']} {last['name']}; "
            f"host-scalar reads (CPU tensors on every device, no GPU wait): "
            f"{first['host_scalar_reads_per_iter']:g} and "
            f"{last['host_scalar_reads_per_iter']:g}.")


def ladder_summary(result: dict) -> list[str]:
    """What a ladder record says, one sentence each: the last stage that ran against stage 0
    and against stage 1, the update's share of an iteration once the env step is vectorized
    on the device (stages 3 on), and the reads."""
    rows = result.get("ladder", [])
    ok = _ok(rows)
    names = list(ok)
    if len(names) < 2:
        return []
    last = names[-1]
    said = [compare_stages(rows, first, last) for first in names[:2] if first != last]
    said.append(update_share(rows, [n for n in names if ok[n]["stage"] >= 3]))
    said.append(reads_story(rows))
    return said


def _span(samples: list[float]) -> tuple[float, float]:
    return (min(samples), max(samples)) if samples else (0.0, float("inf"))


def _apart(a: tuple[float, float], b: tuple[float, float]) -> int:
    """-1 if every value of ``a`` is below every value of ``b``, 1 if above, 0 if they overlap."""
    return -1 if a[1] < b[0] else 1 if a[0] > b[1] else 0


def _iterations(row: dict) -> list[float]:
    """The row's timed iterations (seconds), or its min / median / max, or its median."""
    samples = row.get("iteration_s_samples") or row.get("iteration_s_spread")
    if samples:
        return list(samples)
    return [row["n_envs"] * row["n_steps"] / row["sps"]] if "n_steps" in row else []


def versus(before: dict, after: dict, names: tuple[str, str] | None = None) -> str:
    """How the row ``after`` compares with the row ``before`` (two ``measure_stage`` rows at the
    same N and T): the ratio of their median env steps/s, and whether their timed iterations
    tell them apart. ``names`` labels them (default: ``stage <index>``)."""
    a_name, b_name = names or (f"stage {before['stage']}", f"stage {after['stage']}")
    samples = after["n_envs"] * after["n_steps"]
    a_sps, b_sps = samples / before["iteration_s"], samples / after["iteration_s"]
    a_span, b_span = _span(_iterations(before)), _span(_iterations(after))
    side = _apart(b_span, a_span)
    if side < 0:
        verdict = (f"every timed iteration of {b_name} was faster than every one of {a_name}: "
                   "a difference beyond this run's spread")
    elif side > 0:
        verdict = (f"every timed iteration of {b_name} was slower than every one of {a_name}: "
                   "a difference beyond this run's spread")
    else:
        verdict = (f"their timed iterations overlap ({b_name} {1e3 * b_span[0]:.0f}-"
                   f"{1e3 * b_span[1]:.0f} ms, {a_name} {1e3 * a_span[0]:.0f}-"
                   f"{1e3 * a_span[1]:.0f} ms): within this run's spread, a difference it "
                   "cannot resolve")
    return (f"{b_name} ran at {b_sps / a_sps:.2f}x {a_name}'s median env steps/s "
            f"({b_sps:,.0f} vs {a_sps:,.0f}); {verdict}")


def ranked(row: dict, others: list[dict]) -> str:
    """Where ``row`` stands against each of ``others`` (rows of one run, at its N and T) by the
    rule of :func:`versus`: faster or slower where every timed iteration says so, otherwise
    within the run's spread."""
    mine = _span(_iterations(row))
    sides: dict[int, list[str]] = {-1: [], 0: [], 1: []}
    for other in others:
        sides[_apart(_span(_iterations(other)), mine)].append(str(other["stage"]))
    said = [f"faster than stage(s) {', '.join(sides[1])}" if sides[1] else "",
            f"slower than stage(s) {', '.join(sides[-1])}" if sides[-1] else ""]
    said = [s for s in said if s] or ["apart from no stage"]
    tied = (f"; within the spread of stage(s) {', '.join(sides[0])}: the run cannot tell them "
            "apart") if sides[0] else ""
    return f"stage {row['stage']} is {' and '.join(said)} beyond this run's spread{tied}"


def phase_moved(before: dict, after: dict, phase: str) -> str:
    """How one phase moved from ``before`` to ``after`` (medians of the phase-marked iterations)
    and whether the two rows' marked iterations tell it apart."""
    def times(row: dict) -> list[float]:
        return [ms.get(phase, 0.0) for ms in row.get("phase_ms_samples") or [row["phase_ms"]]]

    a, b = before["phase_ms"].get(phase, 0.0), after["phase_ms"].get(phase, 0.0)
    side = _apart(_span(times(after)), _span(times(before)))
    verdict = ("the marked iterations overlap: within this run's spread" if side == 0 else
               f"{'shorter' if side < 0 else 'longer'} in every marked iteration: beyond this "
               "run's spread")
    return f"{phase} {a:.1f} -> {b:.1f} ms per iteration ({verdict})"
