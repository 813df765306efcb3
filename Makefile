# `make demo` and `make test` do all set-up on a fresh machine: they create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.murmur-installed

.PHONY: demo test test-fast lint venv clean-venv

venv: $(STAMP)

# torch first, pinned, so pip takes the CPU wheel on local disk instead of a multi-GB CUDA build;
# libp2p compiles fastecdsa, which needs gcc and libgmp's headers.
$(STAMP): pyproject.toml
	@printf '#include <gmp.h>\n' | gcc -E - >/dev/null 2>&1 || { \
	  echo "installing build prerequisites (gcc, libgmp-dev)"; \
	  apt-get update -q && apt-get install -y -q gcc libgmp-dev; }
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/murmur demo

# The browser tests drive Debian's chromium through playwright (`playwright install` cannot download here).
CHROMIUM := /usr/bin/chromium

$(CHROMIUM):
	apt-get update -q && apt-get install -y -q chromium

# tests/test_swarm_prometheus.py scrapes a swarm with a real Prometheus, Debian's, which it starts
# itself on a free loopback port: the package's own service is not wanted (where systemd starts
# it, it is stopped and disabled again).
PROMETHEUS := /usr/bin/prometheus

$(PROMETHEUS):
	apt-get update -q && apt-get install -y -q --no-install-recommends prometheus
	if command -v systemctl >/dev/null; then systemctl disable --now prometheus.service >/dev/null 2>&1 || true; fi

# Lint and types first: a finding fails `make test` before pytest starts.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Two workers, one test file each at a time (module-scoped swarms stay on one worker): a node
# process's test mostly waits on its nodes, so one worker alone leaves a core idle. Three ran the
# suite sooner but broke timing bounds of the multiprocess tests (docs/benchmarks.md, "The test suite").
test: lint $(CHROMIUM) $(PROMETHEUS)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder

# The fast tier: in-process unit and property tests, about a minute in all (the in-process
# training and SPES tests that take seconds each are marked `slow` and left out).
test-fast: $(STAMP)
	$(PY) -m pytest -m "unit and not slow"

# The container tier alone (part of `make test`): it installs podman itself; see docs/deploy.md.
.PHONY: test-container
test-container: $(STAMP)
	$(PY) -m pytest -m container -s

clean-venv:
	rm -rf $(VENV)
