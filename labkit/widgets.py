"""ipywidgets controls for the notebooks: pick device, N and stages, then run the ladder."""
from __future__ import annotations

import torch

from .stages import STAGES


def devices() -> list[str]:
    """Devices this machine can run: the CPU and every CUDA device."""
    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def ladder_controls(n_envs: int = 32, n_steps: int = 128, stages: tuple[int, ...] | None = None):
    """A small form: device, N, T and stages; "Run" measures them and shows table + bars."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    from .bench import format_ladder, run_ladder
    from .config import BenchConfig
    from .plots import ladder_bars

    device = w.Dropdown(options=devices(), value=devices()[-1], description="device")
    n = w.Dropdown(options=[2**k for k in range(4, 17)], value=n_envs, description="N envs")
    t = w.Dropdown(options=[32, 64, 128, 256], value=n_steps, description="T steps")
    pick = w.SelectMultiple(options=[(f"{s.index} {s.name}", s.index) for s in STAGES],
                            value=stages if stages is not None else tuple(range(1, 8)),
                            rows=len(STAGES), description="stages")
    run = w.Button(description="Run", button_style="primary")
    out = w.Output()

    def on_run(_) -> None:
        out.clear_output()
        with out:
            profile = "full" if device.value.startswith("cuda") else "quick"
            cfg = BenchConfig.from_profile(profile, n_envs=n.value, n_steps=t.value)
            result = run_ladder(cfg, torch.device(device.value),
                                stages=[STAGES[i] for i in pick.value], scaling=False,
                                profile=profile)
            print(format_ladder(result))
            ladder_bars(result)
            plt.show()

    run.on_click(on_run)
    form = w.VBox([w.HBox([device, n, t]), pick, run, out])
    display(form)
    return form
