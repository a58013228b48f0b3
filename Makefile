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
	$(VENV)/bin/stratagem profile llama-3-8b --seq-len 4096
	$(VENV)/bin/advise --model llama-3-8b --cluster 2x8xH100-SXM-80GB:ib-ndr --global-batch-size 256 --seq-len 4096
	$(VENV)/bin/advise --model mixtral-8x7b --cluster 4x8xH100-SXM-80GB:ib-ndr --global-batch-size 512 --seq-len 4096 --top 3
	$(VENV)/bin/advise --model resnet-50 --cluster 8xA100 --global-batch-size 1024 --target accelerate --top 3
	$(VENV)/bin/advise --model llama-2-70b --cluster 2x8xH100-SXM-80GB:ib-ndr --global-batch-size 64 --seq-len 4096 --format html --output advise-llama-2-70b.html
	# a model that fits nowhere: the report says what would make it fit (exit status 1)
	-$(VENV)/bin/advise --model llama-2-70b --cluster 1xL4 --global-batch-size 8 --seq-len 4096
	# train with the plan the advisor picks: Trainer(strategy="auto-parallel") on 2 CPU processes
	$(PY) examples/lightning_gpt.py
	# a pinned pipeline plan (1F1B over two stages) through the same strategy
	$(PY) examples/lightning_pipeline.py

test: install-dev
	$(PY) -m pytest tests -q

clean:
	rm -rf $(VENV) build *.egg-info advise-*.html checkpoints
