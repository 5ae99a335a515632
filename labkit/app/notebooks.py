"""The chapters' notebooks as ``make record`` keeps them: executed in place (on a GPU, into a
copy beside the results: :mod:`labkit.book.gpu_copies`), stamped with the device, torch and
commit they ran on, each widget stored as what it showed (:func:`strip_widgets`)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..device import run_metadata
from ..files import atomic_write, read_json_object


def execute_notebook(path: Path, device: torch.device, commit: str, timeout: int = 900,
                     out: Path | None = None) -> Path:
    """Execute ``path`` (in its own folder, its relative paths as they are there) and write
    it, outputs and widget state stored, in place or to ``out``, stamped in its metadata with
    the device, its name, torch and the commit."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    strip_widgets(nb)
    merge_streams(nb)
    meta = run_metadata(device)
    nb.metadata["labkit"] = {"device": device.type, "device_name": meta["device_name"],
                             "torch": meta["torch"], "git_commit": commit, "date": meta["date"]}
    out = path if out is None else out
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out) as f:
        nbformat.write(nb, f)
    return out


def merge_streams(nb: dict) -> dict:
    """One output per run of stream outputs of the same name, as a live notebook shows them:
    the kernel may flush a print's text and its newline apart, and a page built from the
    stored notebook would show the newline alone as a blank output."""
    for cell in nb.get("cells", []):
        merged: list = []
        for out in cell.get("outputs", []):
            last = merged[-1] if merged else None
            if out.get("output_type") == "stream" and last is not None \
                    and last.get("output_type") == "stream" and last.get("name") == out.get("name"):
                last["text"] = _text(last) + _text(out)
            else:
                merged.append(out)
        if "outputs" in cell:
            cell["outputs"] = merged
    return nb


def _text(out: dict) -> str:
    """A stream output's text (nbformat stores it as a string or a list of lines)."""
    return out["text"] if isinstance(out["text"], str) else "".join(out["text"])


_VIEW = "application/vnd.jupyter.widget-view+json"


def strip_widgets(nb: dict) -> dict:
    """Store what a widget showed, not the widget: a page built from the stored notebook (or
    a notebook opened without its kernel) has no widget manager, so a widget output renders
    blank or from its text fallback, which for a tqdm bar is its first frame ("0stage").
    Each widget output keeps text: a progress bar its last frame, read from the widget state
    stored at execution (description, count, postfix), any other widget its own text; the
    widget view and the notebook's widget state (tens of KB) are dropped."""
    state = nb.get("metadata", {}).pop("widgets", {}).get(
        "application/vnd.jupyter.widget-state+json", {}).get("state", {})
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            view = data.pop(_VIEW, None)
            if view is not None:
                said = _last_frame(state, view.get("model_id", ""))
                if said:
                    data["text/plain"] = said
    return nb


def _last_frame(state: dict, model_id: str) -> str:
    """A tqdm bar's last frame from its stored widget models (an HBox of the label, the bar
    and the counts), or "" for another widget."""
    import html

    model = state.get(model_id, {})
    children = [state.get(c.removeprefix("IPY_MODEL_"), {})
                for c in model.get("state", {}).get("children", [])]
    names = [c.get("model_name") for c in children]
    if model.get("model_name") != "HBoxModel" or names != ["HTMLModel", "FloatProgressModel",
                                                           "HTMLModel"]:
        return ""
    label, bar, counts = (c.get("state", {}) for c in children)
    filled = "\u2588" * round(10 * bar.get("value", 0) / (bar.get("max") or 1))
    text = f"{label.get('value', '')}|{filled:<10}|{counts.get('value', '')}"
    return html.unescape(text).replace("\u2007", " ")  # tqdm's figure spaces


def recorded_on(path: Path) -> str | None:
    """The device type a notebook was last recorded on (None if never by ``record``)."""
    meta = read_json_object(path, "a notebook").get("metadata", {})
    return meta.get("labkit", {}).get("device")
