# The project's commands. Each target sets up what it needs; `make test` works on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FASHION_DIR := /usr/share/datasets/fashion-mnist
# run apt-get directly as root, through sudo otherwise (when sudo works without a password)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)

.PHONY: env data test bench clean

env: $(STAMP)  ## the virtual environment with the package installed in editable mode

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[ray]'
	touch $(STAMP)

data: env  ## the embedded dataset: Debian's Fashion-MNIST, else torchvision's download into data/
	@if [ -f $(FASHION_DIR)/train-images-idx3-ubyte.gz ]; then \
		echo "Fashion-MNIST: $(FASHION_DIR)"; \
	elif command -v apt-get >/dev/null && { [ -z "$(SUDO)" ] || $(SUDO) true 2>/dev/null; } \
		&& $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq dataset-fashion-mnist; then \
		echo "Fashion-MNIST: installed into $(FASHION_DIR)"; \
	else \
		echo "apt-get unavailable: downloading Fashion-MNIST with torchvision into data/"; \
		$(PY) -c "import torchvision; torchvision.datasets.FashionMNIST('data', download=True)"; \
	fi

test: env data  ## the whole test suite
	MPLBACKEND=Agg FEDLAB_CACHE_DIR=$$(mktemp -d) $(PY) -m pytest -q

bench: env data  ## speed measurements (ratios, not tests)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) .fedlab_cache .pytest_cache
