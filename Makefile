# graphtrim — set-up, demo, tests and benchmark.
# `make demo` and `make test` each build the virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.graphtrim-installed
TORCH_PIN := torch==2.13.0

.PHONY: install demo test test-fast test-durations faults browser faketime lint typecheck docs docs-serve bench bench-variants bench-tune bench-tune-pool bench-input-cache bench-llm bench-llm-graph bench-llm-pipeline bench-scale bench-nodetests corpus sweep deployment clean

INSTALL_LOG := build/install.log

# pip's output goes to $(INSTALL_LOG) (its last lines are shown when the install fails)
$(STAMP): pyproject.toml constraints.txt
	@mkdir -p build
	@echo "installing graphtrim and its dependencies into $(VENV) (minutes the first time; log: $(INSTALL_LOG))"
	@{ $(PYTHON) -m venv $(VENV) && \
	  $(PY) -m pip install --quiet --upgrade pip && \
	  : "torch first: the CPU wheel is pinned so that later ranges resolve to it" && \
	  $(PY) -m pip install --quiet $(TORCH_PIN) && \
	  $(PY) -m pip install --quiet -c constraints.txt -e '.[cpu,reports,dev,docs,bench,pipeline,airflow,kubeflow,distributed]'; \
	} > $(INSTALL_LOG) 2>&1 || { tail -n 30 $(INSTALL_LOG); echo "the install failed: $(INSTALL_LOG)"; exit 1; }
	@touch $(STAMP)

install: $(STAMP)

# graphtrim's own lines on the console; everything else in out/demo/demo.log
demo: $(STAMP)
	@$(PY) -m graphtrim.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check optimizer_core operators demo dags tests bench docs
	$(VENV)/bin/ruff format --check optimizer_core operators demo dags tests bench docs

# mypy reads the package as it installs (graphtrim/, see pyproject.toml), linked under build/
typecheck: $(STAMP)
	$(PY) -m tests.package_tree build/typecheck >/dev/null
	$(VENV)/bin/mypy

# the UI tests drive Debian's Chromium (headless); installed here when missing and run as root
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; }; }; } || \
	  echo "no chromium and none installed: the browser tests will fail (apt-get install chromium)"

# the fault suite's clock fault runs a stage on a clock 10 minutes ahead with libfaketime (apt's
# faketime); installed here when missing and run as root
faketime:
	@[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q faketime >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -q faketime >/dev/null 2>&1; }; }; } || \
	  echo "no libfaketime and none installed: the clock fault tests will fail (apt-get install faketime)"

# the documentation site (mkdocs.yml): strict, so a broken link, a page missing from the nav or
# a stale API reference fails; the CLI, run-parameter, Helm and benchmark sections are generated
docs: $(STAMP)
	MLFLOW_DISABLE_TELEMETRY=true NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# the site on http://127.0.0.1:8000, rebuilt on every change
docs-serve: $(STAMP)
	MLFLOW_DISABLE_TELEMETRY=true NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr 127.0.0.1:8000

test: $(STAMP) lint typecheck docs browser faketime
	$(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=25

# the edit loop: everything that needs no server, no venv of its own and no browser, and is not
# slow (tests/tiers.py fails a test here that starts one of those without its marker)
test-fast: $(STAMP)
	GRAPHTRIM_TEST_TIER=fast $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder \
	  -m "not slow and not server and not venv and not browser"

# each test's seconds from the last run (.test-artifacts/durations.json, written by every run) as
# the record that marks tests over a second slow and orders the files; after a full `make test`
test-durations:
	@[ -s .test-artifacts/durations.json ] || { echo "no recorded run: make test first"; exit 1; }
	cp .test-artifacts/durations.json tests/durations.json

# every fault at every point (tests/faults; `make test` runs one point per fault), and the outcome
# table the documentation shows (docs/operations/data/faults.json, with the commit and date)
faults: $(STAMP) faketime
	GRAPHTRIM_FAULTS=full GRAPHTRIM_FAULTS_PUBLISH=1 $(PY) -m pytest -q tests/faults -m faults

bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

bench-variants: $(STAMP)
	$(PY) -m bench.variants $(BENCH_ARGS)

# the settings search against the fixed recipes on six kinds of model, and its memory
bench-tune: $(STAMP)
	$(PY) -m bench.tune $(BENCH_ARGS)

# the settings search over a worker pool: one gpu worker against two (Celery deployment)
bench-tune-pool: $(STAMP)
	$(PY) -m bench.tune_pool $(BENCH_ARGS)

# the fetch time a settings search's trial tasks save with the per-worker input cache
bench-input-cache: $(STAMP)
	$(PY) -m bench.input_cache $(BENCH_ARGS)

# weight-only variants of a Llama-like decoder with its KV cache, against onnxruntime-genai's
# model builder (installed into bench/.genai on first use)
bench-llm: $(STAMP)
	$(PY) -m bench.llm $(BENCH_ARGS)

# the graph optimizer on a Llama-like decoder with its KV cache (opset 22 and 23), against the
# anchors and onnxruntime-genai's model builder's own graph
bench-llm-graph: $(STAMP)
	$(PY) -m bench.llm_graph $(BENCH_ARGS)

# a Llama-like model over 2 GB through every pipeline stage: wall time and peak RSS per stage
bench-llm-pipeline: $(STAMP)
	$(PY) -m bench.llm_pipeline $(BENCH_ARGS)

bench-scale: $(STAMP)
	$(PY) -m bench.scale $(BENCH_ARGS)

# every onnx backend node test that onnxruntime runs, optimized and compared with its expected outputs
bench-nodetests: $(STAMP)
	$(PY) -m bench.nodetests $(BENCH_ARGS)

# the generalization corpus (bench/corpus-models, manifest.json): 180+ architectures exported
# offline in export-only venvs, one per framework (.venv-export for torch, .venv-export-tf,
# .venv-export-paddle, .venv-export-sklearn; each created on first use); resumable.
# One family: make corpus BENCH_ARGS="--families tf2onnx"
corpus: $(STAMP)
	$(PY) -m bench.corpus $(BENCH_ARGS)

# graphtrim's defaults against the five anchors on every corpus model, per-family tables
sweep: $(STAMP)
	$(PY) -m bench.sweep $(BENCH_ARGS)

# a distributed deployment on 127.0.0.1 (PostgreSQL, Redis, Celery cpu/gpu workers, MLflow, S3)
deployment: $(STAMP)
	$(PY) -m tests.deployment

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
