# One command each: `make train` (installs, then trains the default run) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch is installed first, so that no other requirement pulls a multi-GB CUDA build.
# On a GPU machine: make TORCH_SPEC=torch
# The rest goes through uv, which keeps the torch already there and installs the ~140 others several times faster
# than pip (the same versions: both resolve the newest releases pyproject.toml admits). Compiled to bytecode at
# install, as pip does: uv leaves it to the first import, and where bytecode is never written
# (PYTHONDONTWRITEBYTECODE) every process then compiles what it imports, which slows every import of Lightning
# (benchmarks/README.md, Figures cited elsewhere).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install train test test-gpu check-gpu bench-gpu lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet uv
	$(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode -e ".[dev]"
	touch $@

install: $(VENV)/.installed

train: install
	$(PY) train.py $(ARGS)

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

# On a GPU machine (make install TORCH_SPEC=torch): the GPU measurements still owed, sized for about 10 minutes in
# all on an H200 (from the step rates benchmarks/README.md gives; not timed yet), each line bounded by its steps (and
# throughput_mfu.py's --run-timeout-s): one-rank ZeRO-3 in float8 beside one process in float8 on the 1.2B Llama, now
# that the float8 scales are precomputed once per step; QLoRA's nf4 base beside a bf16 base (bitsandbytes' CUDA
# kernels); GPT-2's shape compiled whole beside per block (trainer.compile_scope) at batch 12, the MFU goal's model;
# and, with NANOGPT=path/to/nanoGPT, disttrain's and nanoGPT's loss curves from the same initial weights at GPT-2's
# size. benchmarks/README.md (GPU section) names the rows each line fills.
test-gpu: install
	$(PY) benchmarks/throughput_mfu.py --device cuda --cases llama1b --steps 30 --sides single-compile-fp8,zero3-compile-fp8 --run-timeout-s 240
	$(PY) benchmarks/qlora.py --device cuda
	$(PY) benchmarks/throughput_mfu.py --device cuda --cases gpt2 --steps 40 --sides single-compile,single-compile-model --run-timeout-s 240
	$(if $(NANOGPT),$(PY) benchmarks/nanogpt.py --device cuda --nanogpt $(NANOGPT) --same-init --rounds 1 --steps 300,@echo "nanogpt.py --device cuda --same-init skipped: make test-gpu NANOGPT=path/to/nanoGPT")

# On a GPU machine: the GPU's own tests, then the README's commands on the GPU (those that need more GPUs than the
# machine has skip with their one-line error).
check-gpu: install
	DISTTRAIN_TEST_DEVICE=cuda $(PY) -m pytest -m cuda tests/test_cuda.py -p no:xdist -o addopts= -q
	DISTTRAIN_TEST_DEVICE=cuda $(PY) -m pytest tests/test_cli.py -k readme -p no:xdist -o addopts= -q -rs

# On a GPU machine, every GPU table of benchmarks/README.md measured again (longer than test-gpu): GPT-2 and a 1.2B
# Llama beside nanoGPT with NANOGPT=path/to/nanoGPT, each side profiled once more into outputs/gpu-profile, and GPT-2
# at batch 24; both in float8 (trainer.fp8) beside bf16; the framework's overhead over a plain loop on the GPU, and
# where its step's time goes by phase; context parallelism's causal blocks; GPT-2's shape compiled whole beside per
# block in compile_regions.py.
bench-gpu: install
	$(PY) benchmarks/throughput_mfu.py --device cuda $(if $(NANOGPT),--nanogpt $(NANOGPT)) --profile-dir outputs/gpu-profile
	$(PY) benchmarks/throughput_mfu.py --device cuda --cases gpt2 --batch 24 --sides single-compile,nanogpt $(if $(NANOGPT),--nanogpt $(NANOGPT))
	$(PY) benchmarks/throughput_mfu.py --device cuda --sides single-compile,single-compile-fp8,single-compile-fp8-rowwise,zero3-compile-fp8
	$(PY) benchmarks/overhead.py --device cuda --flavour mini --global-batch 64
	$(PY) benchmarks/step_phases.py --device cuda --flavour mini --global-batch 64 --repeats 1
	$(PY) benchmarks/context_kernels.py --device cuda
	$(PY) benchmarks/compile_regions.py --device cuda --models gpt --layers 12 --width 768 --seq 1024 --batch 12 --sides whole,blocks --threads 8

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) outputs/runs outputs/multirun
