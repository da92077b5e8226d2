# make serve: install the runtime dependencies only, then serve the embedded demo model (no GPU needed).
# make test:  install the runtime and the test extras (and, as root, the system tools the tests
#             drive: Debian's chromium and docker-compose), then run the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
TESTING := $(VENV)/.installed-test
SYSTEM_TOOLS := chromium docker-compose

.PHONY: install serve test system-tools bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(RUNTIME): setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $(RUNTIME)

$(TESTING): $(RUNTIME)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(TESTING)

install: $(RUNTIME)

# Debian's packages, installed when missing and we are root (CI is); otherwise the tests that need
# them say what to install.
system-tools:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing$$missing (Debian packages)"; \
	    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends$$missing >/dev/null; \
	  else echo "not installed:$$missing (the tests that drive them need: apt-get install$$missing)"; fi; \
	fi

serve: $(RUNTIME)
	$(BIN)/moebus serve $(ARGS)

# Two pytest-xdist workers (CI has 2 cores); tests/conftest.py says how the tests are shared out.
# TEST_WORKERS=0: one process, in the collection's order.
TEST_WORKERS ?= 2
test: $(TESTING) system-tools
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder) $(PYTEST_ARGS)

bench: $(RUNTIME)
	$(BIN)/moebus bench decode

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info tests/artifacts
