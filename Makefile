# renderfleet: `make run` renders the bundled example; `make test` runs the suite.
# Both create the virtual environment and install everything on a fresh machine.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned exactly: a looser range makes pip pull a multi-GB CUDA build
# on a machine that has none. On a GPU node, PyPI's 2.13.0 build carries CUDA.
TORCH  := torch==2.13.0
PYTEST_ARGS ?=
# Three test processes (pytest-xdist), a file each at a time: most integration tests wait on leases,
# restarts and workers starting, and with two the 2 cores sat 25 % idle through the integration tests
# (sampled from /proc/stat); a third fills them. The tests hold under a CPU hog on one core beside them.
PYTEST_WORKERS ?= 3
# Python's own default: each module compiled once, into __pycache__ (ignored by git). A machine whose
# environment sets PYTHONDONTWRITEBYTECODE (this project's do) compiles our modules again in every
# process: about 0.3 s of CPU for each of the suite's ~450 CLI, worker and monitor starts.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install constraints browser kubectl run test test-slow test-unit test-integration chaos soak bench gpu-check gpu-check-families lint clean

install: $(VENV)/.installed

# The web page's browser test drives Debian's chromium through Playwright (Playwright's own
# browser download is never used): installed once here when /usr/bin/chromium is missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# constraints.txt holds every dependency at the version the suite last passed with (`make constraints`):
# a fresh install resolves to those, not to whatever was released since. torch is not in it: $(TORCH) is.
# --no-compile: pip byte-compiles every module of every package it installs (torch, transformers, moto, scipy:
# 36 of a fresh install's 96 s here), where a run compiles only what it imports, once (into __pycache__).
$(VENV)/.installed: pyproject.toml Makefile constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-compile -c constraints.txt $(TORCH)
	$(BIN)/pip install --quiet --no-compile -c constraints.txt -e '.[worker,dev,bench]'
	touch $@

# Writes constraints.txt from this checkout's .venv, as it is now (after a `pip install -U` that the
# suite passes with): `pip freeze` less the project itself (editable) and torch (pinned above, whose
# local build tag, +cpu or +cu128, names one machine's wheel). The images install with it too.
# From another environment: make constraints VENV=/path/to/venv
constraints:
	{ echo "# Every dependency's version, from a .venv the suite passed with: written by make constraints"; \
	  echo "# (docs/development.md). Used by make install and both images (pip install -c constraints.txt)."; \
	  $(BIN)/pip freeze --exclude-editable --exclude renderfleet --exclude torch; } > constraints.txt

# The bundled example on the embedded default (private Redis, ./renderfleet-output),
# with the built-in random-weight `tiny` model: a smoke test of the whole path.  The first one
# takes about 4-5 minutes on 2 cores, most of it installing torch. It ends with the next command:
# bin/renderfleet runs the CLI from .venv (README.md, "Two commands on a fresh machine").
run: install
	$(BIN)/renderfleet run examples/prompts.txt --workers 2 --model tiny --steps 4 --size 64x64 \
		--shard-size 4 --batch-size 4
	@echo 'next: bin/renderfleet status'

# Only the tests need a browser: `make run` and `make install` never install one.
browser:
	[ -x /usr/bin/chromium ] || { $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium; }

# `status --watch` is tested in a real 80x24 terminal (tests/integration/test_status_view.py): tmux, from Debian.
terminal:
	command -v tmux >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y tmux; }

# tests/integration/test_deploy_files.py checks our Kustomize renderer (testing/kustomize.py) against
# `kubectl kustomize` (kustomize v5: `patches:`, folders as resources). kubectl comes from the
# Kubernetes (or Google Cloud) apt repository where the machine has one, as this project's machines
# do. Debian's own kubernetes-client is kubectl 1.20 with kustomize v2, which cannot load a folder as
# a resource: it is not used. With neither, that one test skips and says why.
kubectl:
	command -v kubectl >/dev/null || $(SUDO) apt-get install -y kubectl \
		|| { $(SUDO) apt-get update && $(SUDO) apt-get install -y kubectl; } \
		|| echo "make: no kubectl package here: test_the_renderer_agrees_with_kubectl_kustomize will skip"

# Every tier but the long one (tests marked slow: `make test-slow`): about 10 to 12 minutes on 2 cores,
# lint included. Each slow test plays a whole scenario whose parts have tests of their own in this tier.
# The lint runs beside the tests, its output kept and shown after theirs: mypy from a fresh clone (no cache)
# is about a minute of one core, which the tests' waits on leases and worker starts leave idle anyway;
# either failing fails the target.
test: install browser terminal kubectl
	@rm -f $(VENV)/lint.log; \
	$(MAKE) --no-print-directory lint > $(VENV)/lint.log 2>&1 & lint=$$!; \
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS); tests=$$?; \
	wait $$lint; linted=$$?; echo "---- make lint (run beside the tests) ----"; cat $(VENV)/lint.log; \
	[ $$linted -eq 0 ] || echo "make: lint failed (exit $$linted)"; \
	[ $$tests -eq 0 ] && [ $$linted -eq 0 ]

# The long tier (about 8 minutes on 2 cores): the short chaos run, the spot pool grown and shrunk by
# the autoscaler, bench/gpu.sh's CPU dry run with inductor, `renderfleet run` into two stores.
test-slow: install kubectl
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m slow $(PYTEST_ARGS)

test-unit: install
	$(BIN)/pytest -q tests/unit

test-integration: install browser terminal kubectl
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile tests/integration

# The long chaos run: 400 prompts, 3 workers, random SIGKILLs, a spot notice, workers SIGSTOPped past
# their lease, a kill between a message's fetch and its claim, a Redis restart with every worker
# mid-shard, and a poison job (a model that will not load) on the same queue.
chaos: install
	RENDERFLEET_CHAOS_PROMPTS=400 RENDERFLEET_CHAOS_KILLS=12 RENDERFLEET_CHAOS_STALLS=2 RENDERFLEET_CHAOS_POISON=6 \
	  $(BIN)/python -m bench.chaos

# The soak (not part of `make test`): 5,000 prompts through 3 workers (9-10 minutes on 2 shared cores,
# after 8-13 minutes of rendering the reference here),
# a SIGKILL every 30 s, a spot notice every 2 minutes, one Redis restart and one S3 pause; prints the
# images, duplicates, work lost per kill, worker and Redis memory, the longest wait, and writes its
# section of bench/RESULTS.md.  A short one: python -m bench.soak --prompts 300 --kill-every 10 ...
soak: install
	$(BIN)/python -m bench.soak --results bench/RESULTS.md

# Each writes its own section of bench/RESULTS.md (between its markers, with the command, date, machine and load).
bench: install
	$(BIN)/python -m bench.submit_bench
	$(BIN)/python -m bench.render_bench
	# issue 39: generate, a Lanczos x2, a refine and the tiny x4 upscaler, each step timed (about 4 minutes on 2 cores)
	$(BIN)/python -m bench.stage_bench
	$(BIN)/python -m bench.fleet_bench --no-before
	$(BIN)/python -m bench.reclaim_bench
	# issue 27: 1,000 to 50,000 simulated workers on one Redis (the old protocol beside, up to 5,000)
	$(BIN)/python -m bench.redis_scale --sizes 1000,5000,20000,50000 --leases 6,12 --seconds 60 --before

# The one short run a lent GPU allows, under 9 minutes on one H200 (estimated: not yet run whole on a card), in
# issue 48's order of importance, each step in what the limit leaves: SDXL 1024x1024 compiled (bench/gpu.sh),
# FLUX.1-dev and -schnell at full depth in bf16 and fp8-dynamic, each phase timed apart (bench/gpu_flux.py),
# SD 1.5 compiled, one real worker against the pipeline figure (bench/gpu_worker.py), the GPU test tier; a step
# that does not fit is skipped, saying so; the figures into bench/RESULTS.md (section gpu). Without CUDA, a dry
# run at toy sizes in the same order (about 4 minutes on 2 busy cores) that writes nothing and names each step
# only a card can run. No `install` here: a GPU node has no PyPI; it uses .venv where there
# is one, else python3 (bench/gpu_check.sh says in one line which packages are missing).
gpu-check:
	bench/gpu_check.sh

# A shorter lease's run: the tier's SD3 and FLUX tests and the benchmark's SD3.5-medium- and FLUX.1-shaped
# models alone, under 4 minutes on one H200 (section gpu-families of bench/RESULTS.md).
gpu-check-families:
	bench/gpu_check.sh --families-only

lint: install
	$(BIN)/ruff check renderfleet worker dispatcher testing tests bench
	$(BIN)/ruff format --check renderfleet worker dispatcher testing tests bench
	$(BIN)/mypy renderfleet worker dispatcher
	$(BIN)/hadolint docker/Dockerfile.worker docker/Dockerfile.dispatcher
	$(BIN)/kubernetes-validate --strict --quiet infra/k8s/base/*.yaml
	# kubernetes-validate has no schema for KEDA's kinds and no option to be given one: KEDA's own CRD
	# schema, kept in infra/schemas with its version, checks them (testing/crd.py, strict)
	$(BIN)/python -m testing.crd infra/k8s/overlays/keda/keda.yaml
	# the overlays are rendered and validated by tests/integration/test_deploy_files.py (testing/kustomize.py)

clean:
	rm -rf $(VENV) renderfleet-output .pytest_cache .mypy_cache .ruff_cache
