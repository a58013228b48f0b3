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
	$(VENV)/bin/stratagem hardware
	$(VENV)/bin/stratagem hardware --cluster 2x8xH100-SXM-80GB:ib-ndr
	$(VENV)/bin/stratagem profile llama-3-8b --seq-len 4096
	$(VENV)/bin/stratagem profile mixtral-8x7b --seq-len 4096
	$(VENV)/bin/stratagem profile resnet-50 --batch-size 32

test: install-dev
	$(PY) -m pytest tests -q

clean:
	rm -rf $(VENV) build *.egg-info
