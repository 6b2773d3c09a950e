PY ?= python3
VENV ?= .venv
# Interpreter used by test/demo/bench. CI brings its own (make test PYTHON=.ci-venv/bin/python);
# only when we use the project venv do targets first make sure it is installed.
PYTHON ?= $(VENV)/bin/python
STAMP := $(VENV)/.installed
NEEDS_SETUP := $(if $(filter $(VENV)/bin/python,$(PYTHON)),setup)

.PHONY: setup system-tools sglang-cpu serve test lint demo kv4-report bench clean textworld alfworld swe train \
	setup-swe swe-data

setup: system-tools $(STAMP)

# System tools the tests need: bubblewrap (the SWE jail), git and patch (SWE tasks, SWE-bench grading), setpriv and
# unshare (util-linux; as root the jail drops to nobody with them). Missing ones are installed when this runs as
# root with apt; otherwise the command to run is printed and setup goes on (the SWE tests then skip). STRICT=1
# fails instead (CI, setup-swe). Entries are command=package.
SYSTEM_TOOLS ?= bwrap=bubblewrap git=git patch=patch setpriv=util-linux unshare=util-linux
APT_GET ?= apt-get
STRICT ?=
missing_packages = for t in $(SYSTEM_TOOLS); do command -v "$${t%%=*}" >/dev/null || echo "$${t\#*=}"; done | sort -u | xargs

system-tools:
	@missing=$$($(missing_packages)); \
	if [ -n "$$missing" ] && [ "$$(id -u)" -eq 0 ] && command -v $(firstword $(APT_GET)) >/dev/null; then \
		echo "installing system tools: $$missing"; \
		$(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq $$missing; \
		missing=$$($(missing_packages)); \
	fi; \
	if [ -n "$$missing" ]; then \
		sudo=$$([ "$$(id -u)" -eq 0 ] || echo "sudo "); \
		echo "system tools missing: $$missing. Install them with:" >&2; \
		echo "    $${sudo}apt-get install -y $$missing" >&2; \
		command -v apt-get >/dev/null || echo "    (no apt here: the same packages from your distribution)" >&2; \
		[ -z "$(STRICT)" ]; \
	fi

# torch goes in first and pinned, so pip takes the local CPU wheel instead of pulling a CUDA build
# as a dependency of the package; the stamp makes a repeated `make setup` a no-op.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade pip
	$(VENV)/bin/python -m pip install torch==2.13.0
	# fast-downward-textworld (ALFWorld) builds by calling a bare `python`: the venv must come first on PATH
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/python -m pip install -e ".[dev,textworld,alfworld,sglang-cpu,cuda-compile]"
	$(MAKE) sglang-cpu PYTHON=$(VENV)/bin/python
	touch $(STAMP)

# The real SGLang on a CPU box (tests): its wheel and compressed-tensors without dependencies (sglang pins a CUDA
# torch), its pure-Python needs from the `sglang-cpu` extra. A GPU install is the normal `pip install -e .[sglang]`.
sglang-cpu:
	$(PYTHON) -m pip install --no-deps sglang==0.5.17 compressed-tensors==0.20.1

# Two passes: the suite over TEST_WORKERS processes (pytest-xdist, each test file in one worker: its module's server
# or model fixtures are made once), then the `serial` tests alone (a wall-clock or process-count bound that a second
# worker on the same cores would break). CI's 2 cores: 28 min in one process, ~20 in two (2026-12-06).
TEST_WORKERS ?= 2
test: $(NEEDS_SETUP)
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=25 tests
	$(PYTHON) -m pytest -q -m serial --durations=5 tests

lint: $(NEEDS_SETUP)
	$(PYTHON) -m ruff check .

# the main job at CPU scale (configs/demo_textworld.toml): tiny Qwen3 on easy TextWorld games, held-out eval,
# SFT on compacted expert episodes, async GRPO with KV-streams Sliding Window and kv4rl; a table and plots
demo: $(NEEDS_SETUP)
	$(PYTHON) -m harness.demo $(ARGS)

# KV4-RL on one tiny model's real KV: bits per element, bytes vs BF16, attention error per layer
kv4-report: $(NEEDS_SETUP)
	$(PYTHON) -m kvstreams_sglang.kv4_report

# RL runs: make textworld STRATEGY=sliding_window EXEC=kv_streams KV=kv4rl ARGS="--trainer.lr 2e-6"
STRATEGY ?= sliding_window
EXEC ?= kv_streams
KV ?= bf16
ARGS ?=

textworld alfworld swe: $(NEEDS_SETUP)
	$(PYTHON) -m harness.run configs/$@/$(STRATEGY).toml --compaction.execution $(EXEC) --inference.kv_dtype $(KV) $(ARGS)

# SWE tasks offline: system tools for the sandbox, then build and validate the task set
setup-swe:
	$(MAKE) system-tools STRICT=1

swe-data: $(NEEDS_SETUP)
	$(PYTHON) -m envs.swe.build --libs toolz,cachetools,parse,tabulate,boltons --per-lib 40 --max-per-function 2 --out data/swe
	$(PYTHON) -m envs.swe.validate --out data/swe --sample 30

# the CPU-sized RL run of configs/demo.toml (toy corridor, tiny model)
train: $(NEEDS_SETUP)
	$(PYTHON) -m harness.run configs/demo.toml $(ARGS)

# SGLang with kv-streams + kv4rl (GPU install: pip install -e .[sglang]):
#   make serve MODEL=/path/to/model ARGS="--port 30000"
MODEL ?=
serve:
	$(PYTHON) -m kvstreams_sglang.launch_server --model-path $(MODEL) --kv4rl --enable-kv-streams $(ARGS)

bench: $(NEEDS_SETUP)
	$(PYTHON) -m bench.decode_attention

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache runs
	find . \( -path ./$(VENV) -o -path ./.ci-venv -o -path ./.git \) -prune -o \
		-name __pycache__ -type d -prune -exec rm -rf {} +
