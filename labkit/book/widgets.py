"""ipywidgets controls for the notebooks: pick device, N, T and stages, then run the ladder."""
from __future__ import annotations

import torch

from ..stages import STAGES

#: Sizes offered per device type: a CPU ladder at 512 envs already takes minutes.
N_CHOICES = {"cpu": [8, 16, 32, 64, 128, 256, 512],
             "cuda": [256, 1024, 4096, 16384, 65536]}
T_CHOICES = [16, 32, 64, 128]


def devices() -> list[str]:
    """Devices this machine can run: the CPU and every CUDA device."""
    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def ladder_controls(n_envs: int | None = None, n_steps: int | None = None,
                    stages: tuple[int, ...] | None = None):
    """A small form: device, N, T and stages (all nine; the ones that cannot run on the chosen
    device report why); "Run" measures them with a progress bar, then shows the table, the
    phases and the bars. On GitHub, where widgets do not run, it shows a one-line note; so it
    does where ipywidgets is not installed (and returns None)."""
    try:
        import ipywidgets as w
    except ModuleNotFoundError:
        print("Ladder controls need ipywidgets (pip install ipywidgets); without them, "
              "python -m labkit ladder runs the same ladder")
        return None
    from IPython.display import display

    class LadderForm(w.VBox):
        def __repr__(self) -> str:  # what a renderer without widgets (GitHub) shows
            return "Ladder controls (device, N, T, stages, Run): open the notebook in Jupyter"

    choices = devices()
    device = w.Dropdown(options=choices, value=choices[-1], description="device")

    def sizes(dev: str) -> list[int]:
        return N_CHOICES["cuda" if dev.startswith("cuda") else "cpu"]

    n = w.Dropdown(options=sizes(device.value), description="N envs")
    n.value = n_envs if n_envs in n.options else n.options[2 if len(n.options) > 2 else 0]
    t = w.Dropdown(options=T_CHOICES, value=n_steps if n_steps in T_CHOICES else 64,
                   description="T steps")
    runnable = tuple(s.index for s in STAGES if not s.skip_reason(torch.device(device.value)))
    pick = w.SelectMultiple(options=[(f"{s.index} {s.name}", s.index) for s in STAGES],
                            value=stages if stages is not None else runnable,
                            rows=len(STAGES), description="stages")
    run = w.Button(description="Run", button_style="primary")
    bar = w.IntProgress(value=0, min=0, max=1, description="idle")
    out = w.Output()

    def on_device(change) -> None:
        n.options = sizes(change["new"])
        n.value = n.options[min(1, len(n.options) - 1)]

    def on_run(_) -> None:
        out.clear_output()
        run.disabled = True

        def progress(i: int, total: int, what: str) -> None:
            bar.max, bar.value, bar.description = total, i, what[:20]

        try:
            with out:
                run_and_show(device.value, n.value, t.value, pick.value, progress)
                bar.value, bar.description = bar.max, "done"
        finally:
            run.disabled = False

    device.observe(on_device, names="value")
    run.on_click(on_run)
    form = LadderForm([w.HBox([device, n, t]), pick, w.HBox([run, bar]), out])
    display(form)
    return form


def run_and_show(device: str, n_envs: int, n_steps: int, stages: tuple[int, ...],
                 progress=None) -> None:
    """What the form's "Run" does: the ladder of ``stages`` on ``device`` at N x T (the full
    profile on CUDA, quick otherwise), its tables, and its bars."""
    import matplotlib.pyplot as plt

    from ..config import BenchConfig
    from ..measure.bench import format_ladder, format_phases, run_ladder
    from .plots import ladder_bars, phase_bars

    profile = "full" if device.startswith("cuda") else "quick"
    cfg = BenchConfig.from_profile(profile, n_envs=n_envs, n_steps=n_steps)
    result = run_ladder(cfg, torch.device(device), stages=[STAGES[i] for i in stages],
                        scaling=False, profile=profile, progress=progress)
    print(format_ladder(result))
    print(format_phases(result))
    fig, axes = plt.subplots(1, 2, figsize=(14, 4))
    ladder_bars(result, ax=axes[0])
    phase_bars(result["ladder"], ax=axes[1])
    plt.show()
