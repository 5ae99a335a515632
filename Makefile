# labkit: the README's commands. Each target creates the virtual environment it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# Without a GPU we install the CPU wheel of torch (~200 MB), never the CUDA build (several GB).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
STAMP := $(VENV)/.labkit-installed

.PHONY: ladder test test-fast test-torch211 lab book chromium record report bench-env train lint clean

ladder: $(STAMP)  ## the main job: the ladder on the best device, table + JSON + PNG in results/
	$(BIN)/python -m labkit ladder --out results

test: $(STAMP) chromium  ## unit tests + every notebook under nbval + the book in a browser (CI's run), the 25 slowest listed
	$(BIN)/python -m pytest --nbval --nbval-current-env \
	    --nbval-sanitize-with tests/nbval_sanitize.cfg --durations=25 tests notebooks

# -p no:nbval: no notebook runs here, and the plugin's imports (nbformat's jsonschema) cost ~3 s
test-fast: $(STAMP)  ## the inner loop: unit tests but the slow ones, no notebooks; time by file and the tests over 0.5 s at the end
	$(BIN)/python -m pytest -m "not slow and not notebook" -p no:nbval tests

# torch 2.11 is the version on the GPU machines README's "Recording on a GPU" targets; its CPU
# suite is checked outside CI (its wheel from PyPI brings ~3 GB of CUDA libraries).
VENV211 ?= .venv-torch211
test-torch211:  ## make test-fast under torch 2.11 in its own venv (outside CI: ~3 GB of wheels)
	test -x $(VENV211)/bin/python || $(PYTHON) -m venv $(VENV211)
	$(VENV211)/bin/pip install "torch==2.11.0" -e ".[dev,notebooks,gym,tensorboard,sb3,cleanrl,book]"
	# deselected: the test that says labkit/doctor/kernel_syncs.py was read from another torch
	# (2.13's ATen sources; 2.11's were not read)
	$(VENV211)/bin/python -m pytest -m "not slow and not notebook" -p no:cacheprovider -p no:nbval tests \
	    --deselect tests/test_rehearsal.py::test_the_kernel_sync_table_was_read_from_the_installed_torch

lab: $(STAMP)  ## JupyterLab on the notebooks
	$(BIN)/jupyter lab notebooks

book: $(STAMP)  ## the chapters as a static site from their stored outputs: build/book/index.html
	$(BIN)/python -m labkit.book.site build/book

# The browser the book's test opens pages in: Debian's Chromium, installed where missing and
# allowed (root); never a browser downloaded by Playwright or Selenium Manager.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	    && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
	    || echo "chromium is not installed (apt-get install chromium): the book's browser test skips"

record: $(STAMP)  ## re-record results and notebooks on this machine (see labkit/app/record.py)
	$(BIN)/python -m labkit record

report: $(STAMP)  ## regenerate results/RESULTS.md and the README's results from the JSON
	$(BIN)/python -m labkit report

bench-env: $(STAMP)
	$(BIN)/python -m labkit bench-env --out results

train: $(STAMP)
	$(BIN)/python -m labkit train --out runs/train

lint: $(STAMP)
	$(BIN)/ruff check labkit tests

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),yes)
	$(BIN)/pip install "torch==$(TORCH_VERSION)"
else
	# A CPU wheel already known to pip (its find-links or cache) is used as is; else the CPU index.
	$(BIN)/pip install --no-index --no-deps "torch==$(TORCH_VERSION)" 2>/dev/null || \
	    $(BIN)/pip install "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX) \
	    --extra-index-url https://pypi.org/simple
endif
	$(BIN)/pip install -e ".[dev,notebooks,gym,tensorboard,sb3,cleanrl,book]"
	touch $@

clean:
	rm -rf $(VENV) runs .pytest_cache
