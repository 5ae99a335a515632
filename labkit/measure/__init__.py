"""Measuring: instruments that run the ladder and never change it.

* ``bench``: the harness, every stage measured the same way (warmup off the clock, rounds);
* ``envbench``: the envs alone, env steps/s of the four Forage implementations, a step by parts;
* ``envcrossover``: where ForageNumpy and ForageTorch cross over, and the ops of their steps;
* ``hostflow``: which tensors would live on the host in a GPU run, the data flow behind a read;
* ``kernels``: the kernels a ``torch.compile``'d region launches, counted as it runs;
* ``noise``: when a timing cannot be trusted, and how many CPU threads to time with;
* ``profiling``: ``torch.profiler`` made short: top ops, op counts and census, launches, traces;
* ``sb3bench``: labkit's stage against Stable-Baselines3's PPO on the same work;
* ``syncmeter``: host reads by call site, device reads told from host-scalar reads;
* ``tables``: the results tables, each defined once, as text, Markdown or HTML;
* ``updatebench``: the PPO update alone, in each way a stage can run it, and its floor."""
