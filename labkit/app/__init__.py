"""The application: ``python -m labkit``'s commands, each defined beside its work. One line
per module:

- ``cli``: ``main``, the one exit mapper, and the table of commands
- ``flags``: the flag types, each value checked as it is parsed, and the flags commands share
- ``train_config``: ``TrainConfig``, what a training run is asked to do
- ``run``: a run's folder and ``open_run``, the one door that judges a run (and reads its files)
- ``checkpoint``: checkpoints written atomically, read and their fields checked
- ``train``: ``train()`` opens the run, builds the pipeline and loops; the train command
- ``remembered``: the warm-up choices a run keeps from the last run like it (``choices.json``)
- ``session``: one training process between iterations: its records, logs and checkpoints
- ``ladder``: ladder, bench-env, bench-update and bench-sb3: measure, print, write JSON+figures
- ``profile``: the profile command, a torch.profiler trace of a stage
- ``doctor``: the doctor and rehearse commands, a stage diagnosed and its captures rehearsed
- ``watch``: the watch command, a reader's script run under ``labkit.watch``
- ``plot_runs``: the plot-runs command, the learning curves of train runs
- ``plan``: ``make record``'s parts, their estimates and commands (``record --plan``)
- ``record``: the record command, the session that records the parts
- ``notebooks``: the chapters executed in place and stamped, as ``record`` keeps them
- ``results``: the results files (``LadderFile``, run ids)
- ``report``: the report command, ``results/RESULTS.md`` and the README's results
"""
