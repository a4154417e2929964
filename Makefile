# Entry points: `make demo` and `make test` work on a fresh Debian machine.
BUILD ?= build
CUDA_BUILD ?= build-cuda
JOBS ?= $(shell nproc)
# clang when there is one: with its precompiled header instantiating LibTorch's templates once
# (GCC redoes them in every translation unit) and unity batches, a cold build on 2 cores takes
# 8.5 min instead of GCC's 16. Any C++20 compiler works: `make SHARDRL_CXX=g++ ...`.
SHARDRL_CXX ?= $(shell command -v clang++ 2>/dev/null || echo c++)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=$(SHARDRL_CXX)
# What the CUDA build compiles here, where no GPU runs it: the library and the programs a user
# runs, linked against torch_cuda and NCCL. `make test-cuda` on a GPU machine builds the rest.
CUDA_CHECK_TARGETS ?= shardrl dist_worker
# The tests that run on one GPU: World picks NCCL and cuda:LOCAL_RANK when a GPU is visible. CTest
# names a parameterized test by its value: /1 is world size 1.
CUDA_TESTS ?= ^AdamW\.|^WorldSizes/(ParityTest|OffloadPolicyTest)\..*/1$$
# The parsers' libFuzzer harnesses (clang, ASan + UBSan), in a build dir of their own.
FUZZ_BUILD ?= build-fuzz
FUZZ_FLAGS ?= -max_total_time=7

.PHONY: deps configure build test docs demo smollm2 bench format clean build-cuda test-cuda fuzz-build \
	fuzz-smoke bench-cuda

deps:
	@scripts/install-deps.sh

configure: deps
	@cmake -S . -B $(BUILD) $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

# Tests in parallel, one per core: each holds its ranks to one thread, and ranks of concurrent
# tests cannot meet since `shardrl launch` keeps the port it picked reserved (2 cores: 11 min
# instead of 18 one at a time).
test: build
	cd $(BUILD) && ctest --output-on-failure --timeout 900 -j $(JOBS)

# docs/config.md, every task's config keys, from the tables the parser uses (ConfigReference.
# DocsAreCurrent fails while the committed file differs).
docs: build
	@$(BUILD)/bin/shardrl config --markdown > docs/config.md.tmp
	@mv docs/config.md.tmp docs/config.md

demo: build
	@scripts/demo.sh $(BUILD)

# The second main job: GRPO on a real pretrained model, SmolLM2-135M-Instruct.
# `make smollm2 CONFIG=examples/configs/smollm2_ppo.yaml ARGS="key=value ..."`
smollm2: build
	@SMOLLM2_CONFIG=$(or $(CONFIG),examples/configs/smollm2_grpo.yaml) scripts/smollm2.sh $(BUILD) $(ARGS)

bench: build
	@scripts/bench.sh $(BUILD)

# The CUDA/NCCL build: compiles and links here (CUDA 13 toolkit at /usr/local/cuda, no GPU).
CUDA_CONFIGURE = cmake -S . -B $(CUDA_BUILD) $(CMAKE_FLAGS) -DSHARDRL_CUDA=ON >/dev/null
build-cuda: deps
	@$(CUDA_CONFIGURE)
	@# A changed compiler makes CMake drop the folder's cache and, with it, the -D values of that
	@# very run: configure again rather than build a CPU-only binary under this name.
	@grep -q '^SHARDRL_CUDA:BOOL=ON' $(CUDA_BUILD)/CMakeCache.txt || $(CUDA_CONFIGURE)
	@cmake --build $(CUDA_BUILD) -j $(JOBS) --target $(CUDA_CHECK_TARGETS)

# On a GPU machine: the whole CUDA build, then the tests that run on one GPU with NCCL.
test-cuda: deps
	@cmake -S . -B $(CUDA_BUILD) $(CMAKE_FLAGS) -DSHARDRL_CUDA=ON >/dev/null
	@cmake --build $(CUDA_BUILD) -j $(JOBS)
	cd $(CUDA_BUILD) && ctest --output-on-failure --timeout 900 -R '$(CUDA_TESTS)'

# On a GPU machine: ShardRL beside PyTorch FSDP2 on one GPU (step time, peak memory).
bench-cuda: deps
	@cmake -S . -B $(CUDA_BUILD) $(CMAKE_FLAGS) -DSHARDRL_CUDA=ON >/dev/null
	@cmake --build $(CUDA_BUILD) -j $(JOBS) --target shardrl bench_fsdp
	@scripts/bench-cuda.sh $(CUDA_BUILD)

fuzz-build: deps
	@cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=clang++ \
		-DSHARDRL_FUZZ=ON >/dev/null
	@cmake --build $(FUZZ_BUILD) -j $(JOBS)

# A short run of each harness (FUZZ_FLAGS; -runs=1000000 for the BENCHMARKS.md figures).
fuzz-smoke: fuzz-build
	@scripts/fuzz.sh $(FUZZ_BUILD) $(FUZZ_FLAGS)

format:
	clang-format -i $$(git ls-files '*.cpp' '*.h')

clean:
	rm -rf $(BUILD) $(CUDA_BUILD) $(FUZZ_BUILD)
