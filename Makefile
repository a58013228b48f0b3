# Set-up and the two jobs. Both create .venv when it is missing and install torch==2.13.0
# before the package, so that pip never resolves an open `torch` requirement to a CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: demo test install install-dev clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.torch: $(VENV)/bin/activate
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	touch $@

install: $(VENV)/.torch
	$(PY) -m pip install --quiet -e .

install-dev: $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[dev]"

demo: install
	$(PY) examples/demo.py

test: install-dev
	$(PY) -m pytest tests -q

clean:
	rm -rf $(VENV) build *.egg-info
