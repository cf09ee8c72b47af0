# The project's commands. Each target sets up what it needs, so both work on a fresh clone:
#   make book   executes every notebook with papermill and builds the HTML book (PROFILE=smoke|book|paper)
#   make test   unit tests, every notebook with the smoke profile, a book build, a browser check
SHELL := /bin/bash
PYTHON ?= python3
PROFILE ?= book
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FASHION_DIR := /usr/share/datasets/fashion-mnist
# apt-get runs directly as root, through sudo otherwise (when sudo works without a password)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)

.PHONY: env data browser book test bench lab clean

env: $(STAMP)  ## the virtual environment with the package installed in editable mode

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[ray,test]'
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

browser:  ## Debian's Chromium and ChromeDriver, for the test that opens the built book
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
		echo "Chromium: $$(command -v chromium)"; \
	else \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium chromium-driver; \
	fi

book: env data  ## execute the notebooks (PROFILE=book by default) and build the HTML
	MPLBACKEND=Agg $(PY) -m fedlab_core.book --profile $(PROFILE)

test: env data browser  ## the whole test suite, from scratch
	MPLBACKEND=Agg FEDLAB_CACHE_DIR=$$(mktemp -d) $(PY) -m pytest -q

bench: env data  ## speed measurements (ratios, not tests)
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/augment_overhead.py
	$(PY) benchmarks/fraug_overhead.py

lab: env data  ## JupyterLab on the notebooks, with this environment as the kernel
	$(PY) -m pip install --quiet -e '.[lab]'
	$(PY) -m ipykernel install --sys-prefix --name fedlab --display-name "Python (fedlab)"
	$(VENV)/bin/jupyter lab notebooks/

clean:
	rm -rf $(VENV) .fedlab_cache .pytest_cache book/_build book/chapters artifacts
