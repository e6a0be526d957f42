# sao_jax: every target sets itself up (virtualenv in .venv/, editable install with dev extras).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXP ?= toy
ARGS ?=

.PHONY: install train plan eval test test-durations test-slow test-faults test-sglang sglang test-gpu-compile test-jax-floor bench bench-soak logp-gap notebooks lint clean

install: $(STAMP)

# Re-installs only when setup.py changes.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# PROCS=N: N learner processes on this machine (sao_jax.launch), DEVICES simulated CPU devices
# each: a multi-host learner without the hosts.
PROCS ?=
DEVICES ?= 1
train: $(STAMP)
	$(if $(PROCS),$(PY) -m sao_jax.launch --procs=$(PROCS) --devices_per_process=$(DEVICES) --,$(PY) -m sao_jax.main) --config=experiments/$(EXP).py $(ARGS)

# The learner step of EXP compiled for a TPU slice (TOPOLOGY, default the experiment's
# config.plan.topology) with abstract weights: memory per device, FLOPs, tokens/s; exit 1 when
# it does not fit. Runs on any host: libtpu (the tpu extra) compiles for the TPU.
TOPOLOGY ?=
plan: $(STAMP)
	$(PY) -c "import libtpu" 2>/dev/null || $(PY) -m pip install --quiet -e ".[tpu]"
	$(PY) -m sao_jax.main --config=experiments/$(EXP).py --plan $(if $(TOPOLOGY),--topology=$(TOPOLOGY)) $(ARGS)

# Held-out accuracy of a checkpoint: CKPT=<run dir> | <run dir>/checkpoints/<step> | <HF dir>.
eval: $(STAMP)
	@test -n "$(CKPT)" || (echo "usage: make eval EXP=<name> CKPT=<run dir or checkpoint>"; exit 2)
	$(PY) -m sao_jax.main --config=experiments/$(EXP).py --eval=$(CKPT) $(ARGS)

# Two workers, whole files each (module fixtures such as a running engine stay shared), the
# longest files first (as tests/durations.json measured them: make test-durations;
# --no-loadscope-reorder keeps that order), compiled with XLA's quick CPU passes
# (tests.FAST_COMPILE): 628 s of tests (1492 passed), 12:29 with the virtualenv made first, from
# a clean clone of 574b583 on a quiet 2-core machine, the sandbox and container tests included;
# 703 s (1494 passed), 14:01, from one of 7cb0c17 on the same machine a day later, its files'
# seconds 13% more in sum though most of them had not changed; 627 s (1496 passed), 12:37, from
# one of ae2057e the day after (the learner no longer imports torch, the swe notebook's warm
# start measures 16 transcripts, not 512); 556 s (1501 passed, 2 failed, fixed in the next
# commit) and 602 s (1503 passed), 11:03 and 12:03, from two of the same day's 933bb55 and
# 6c79c08, minutes apart (the tests' runs compile their engines' prefills on first use); 616 s
# (1510 passed), 12:20, from one of 2a8ea79 (routing replay in the ablation's run). The suite is
# CPU-bound: 1.9 of the 2 cores busy
# throughout, and three workers took as long as two. PYTEST_ARGS="-n 0" runs serially.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) tests

# make test, recording each file's seconds into tests/durations.json (commit it): the order in
# which the next runs start the files.
test-durations: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --record-durations $(PYTEST_ARGS) tests

# Long checks (marker `slow`, which `make test` deselects): the warm start's plateau, the
# default run's +40 points, every gold and empty swe_mini patch graded, on podman every gold and
# empty swe_mini patch and every forged one of tests/envs/swe/test_forgery.py (about 6.5 minutes
# of it), a few steps of EXP=swe_mini as a subprocess. About 18 minutes on 2 cores; CI runs the
# swe_mini one (-k swe_mini).
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS) tests

# The fault suite (marker `faults`, which `make test` deselects): real toy runs with two engines
# and two workers, one fault each (an engine killed, a worker killed, an engine frozen, the
# checkpoint disk full, the learner killed five times), each checked for exactly-once data, and a
# 2-process learner whose follower is killed (tests/train/test_multihost.py). About 8 minutes on
# 2 cores; the disk case mounts a tmpfs (root). The SGLang rows (a server killed, frozen,
# refusing an update: tests/faults/test_faults_sglang.py) need SGLang's virtualenv (make sglang)
# and skip without it.
test-faults: $(STAMP)
	$(PY) -m pytest -q -m faults $(PYTEST_ARGS) tests/faults tests/train/test_multihost.py

# SGLang 0.5.23's own virtualenv (it pins its own torch and transformers), made once per machine
# in ~/.cache/sao_jax/sglang-0.5.23 ($$SAO_SGLANG_VENV overrides) and shared by every clone: about
# 5 minutes and 11 GB. `make train EXP=toy_sglang` (rollout.engine = "sglang") makes it on first
# use too.
sglang: $(STAMP)
	$(PY) -m sao_jax.engine.sglang_server

# Real SGLang servers (marker `sglang`, which `make test` deselects): the conformance suite run
# against both engines, log-probs at several temperatures, weight sync (MoE and dense), a short
# make train through SGLang. Makes the virtualenv first; where that fails, the SGLang tests skip
# and say why.
test-sglang: $(STAMP)
	$(PY) -m sao_jax.engine.sglang_server || echo "SGLang's virtualenv could not be made: its tests skip"
	$(PY) -m pytest -q -m sglang $(PYTEST_ARGS) tests

# The kernels compiled for NVIDIA H100 and H200 GPUs on this host, which has none (marker
# `gpu_compile`, which `make test` deselects; tests/kernels/test_gpu_compile.py): XLA's CUDA
# compiler, Triton and ptxas, each compile in a process of its own. They run in a virtualenv of
# their own, .venv-gpu, made on first use: the project with the gpu-compile extra, jax and jaxlib
# at .venv's versions and the CUDA plugin of that version (kept out of .venv: where it is
# installed, JAX without JAX_PLATFORMS=cpu tries to load CUDA at start and logs a traceback on a
# host without it). Remade when setup.py or .venv changes.
GPU_VENV := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed
$(GPU_STAMP): setup.py $(STAMP)
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install --quiet --upgrade pip
	jax=$$($(PY) -c "from importlib.metadata import version; print(version('jax'))") && \
	jaxlib=$$($(PY) -c "from importlib.metadata import version; print(version('jaxlib'))") && \
	$(GPU_VENV)/bin/python -m pip install --quiet -e ".[gpu-compile]" "jax==$$jax" \
	  "jaxlib==$$jaxlib" "jax-cuda12-plugin==$$jaxlib" "jax-cuda12-pjrt==$$jaxlib"
	touch $(GPU_STAMP)

test-gpu-compile: $(GPU_STAMP)
	$(GPU_VENV)/bin/python -m pytest -q -m gpu_compile $(PYTEST_ARGS) tests/kernels

# The oldest JAX setup.py admits (its JAX_FLOOR): the kernels (interpreted, and lowered for TPU
# and CUDA), the models and the RL math on jax and jaxlib at that version, in a virtualenv of
# their own, .venv-jax-floor, made on first use (the project with the jax-floor extra; remade
# when setup.py changes). An API newer than the floor fails here before it fails a user.
JAX_FLOOR := $(shell sed -n 's/^JAX_FLOOR = "\(.*\)".*/\1/p' setup.py)
FLOOR_VENV := .venv-jax-floor
FLOOR_STAMP := $(FLOOR_VENV)/.installed
FLOOR_TESTS := tests/kernels tests/rl tests/models/test_attention.py tests/models/test_moe.py \
	tests/models/test_transformer.py tests/models/test_layout.py tests/train/test_roofline.py
$(FLOOR_STAMP): setup.py
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet -e ".[jax-floor]" "jax==$(JAX_FLOOR)" \
	  "jaxlib==$(JAX_FLOOR)"
	touch $(FLOOR_STAMP)

test-jax-floor: $(FLOOR_STAMP)
	$(FLOOR_VENV)/bin/python -c "import jax; assert jax.__version__ == '$(JAX_FLOOR)', jax.__version__"
	$(FLOOR_VENV)/bin/python -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS) $(FLOOR_TESTS)

bench: $(STAMP)
	$(PY) benchmarks/bench_gae.py
	$(PY) benchmarks/bench_model.py
	$(PY) benchmarks/bench_logprobs.py
	$(PY) benchmarks/bench_engine.py
	$(PY) benchmarks/bench_stream.py
	$(PY) benchmarks/bench_kernels.py
	$(PY) benchmarks/bench_async.py
	$(PY) benchmarks/bench_publish.py

# The training-inference gap at step 0: the embedded engine and the learner on EXP's initial
# policy (its warm start, trained first if not cached), per token, for each pair of dtypes
# (float32 and bfloat16); ARGS='--fresh --config.model.preset=toy_moe' for another model.
# Outside `make bench`, a measurement of numerics, not of speed; its figures are in
# docs/algorithm.md, "The training-inference gap".
logp-gap: $(STAMP)
	$(PY) benchmarks/logp_gap.py --exp=$(EXP) $(ARGS)

# 1000 toy steps: every process's memory after the warm-up, and the stream's accounting
# (about 4 minutes on 2 cores; outside `make bench`).
bench-soak: $(STAMP)
	$(PY) benchmarks/bench_soak.py $(ARGS)

# The notebooks (experiments/notebooks) executed on their committed results (LAUNCH = False: no
# runs), each written beside its .py as an .ipynb with its figures and tables drawn.
notebooks: $(STAMP)
	for nb in experiments/notebooks/*.py; do \
	  $(PY) -c "import sys; from sao_jax import lab; lab.run_notebook(sys.argv[1], output=sys.argv[1][:-3] + '.ipynb')" $$nb || exit 1; done

lint: $(STAMP)
	$(PY) -m ruff check sao_jax kernels tests benchmarks experiments

clean:
	rm -rf $(VENV) $(GPU_VENV) $(FLOOR_VENV) *.egg-info .pytest_cache .ruff_cache .hypothesis
