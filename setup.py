"""sao_jax: Single-rollout Asynchronous Optimization (SAO) for LLM agents, in JAX."""

from setuptools import find_packages, setup

# The oldest JAX the code runs on: `lax.stack` and `lax.unstack` (the GAE kernel's pair scan)
# came in 0.10.1. `make test-jax-floor` runs the kernels', models' and RL math's tests on it.
JAX_FLOOR = "0.10.1"

setup(
    name="sao_jax",
    version="0.1.0",
    description="Asynchronous single-rollout RL (SAO) for LLM agents: GAE, DIS, value models, in JAX.",
    python_requires=">=3.10",
    # The Pallas kernels are the top-level kernels/ folder, installed as `sao_jax.kernels`
    # (sao_jax/kernels.py is that package's face and names the folder as its `__path__`;
    # docs/layout.md, "How the kernels are packaged"). kernels/ has no __init__.py, so that it never
    # shadows Hugging Face's own `kernels`, hence the explicit entry besides find_packages.
    packages=find_packages(include=["sao_jax", "sao_jax.*"]) + ["sao_jax.kernels"],
    package_dir={"sao_jax.kernels": "kernels"},
    # the CPU GAE kernel's C++ source, compiled on first use (kernels/gae_cpu.py)
    package_data={"sao_jax.kernels": ["*.cc"]},
    install_requires=[
        # Ranges, never exact pins: accelerator images bring their own JAX build.
        f"jax>={JAX_FLOOR}",
        "numpy>=1.26",
        "flax>=0.12",
        "optax>=0.2.5",
        "aiohttp>=3.9",
        # The generated trajectory_pb2 modules check these versions when imported.
        "grpcio>=1.85.1",
        "protobuf>=7.35.1",
        "grain>=0.2.18",
        # The learner: configs, checkpoints, logs.
        "ml-collections>=1.0",
        "absl-py>=2.0",
        "orbax-checkpoint>=0.11",
        "tensorboardX>=2.6",
        # Hugging Face tokenizers and their chat templates (experiments/tir.py).
        "tokenizers>=0.20",
        "jinja2>=3.1",
        # The sandbox's seccomp filter (denies the kernel keyring calls); needs libseccomp2.
        "pyseccomp>=0.1.2",
    ],
    extras_require={
        # torch (the CPU build, pinned) and transformers are test-time references only.
        # pytest-timeout: a hung engine or server fails its test instead of hanging the suite
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "pytest-timeout>=2.3", "hypothesis>=6.100",
                "ruff>=0.6",
                # the tests' references: chex's assertions, safetensors' own reader and writer
                "chex>=0.1.88", "safetensors>=0.4",
                "torch==2.13.0", "transformers>=4.51", "grpcio-tools>=1.85.1",
                # the recording proxy's tests drive it with OpenAI's own client, and run
                # mini-swe-agent against it
                "openai>=1.0", "mini-swe-agent>=2.0,<3",
                # libtpu: the tests compile the learner step and the kernels for a TPU
                # topology with the real TPU compiler, on this CPU host (make plan)
                f"jax[tpu]>={JAX_FLOOR}",
                # sao_jax.lab, the notebook API (tests/test_lab.py), and the notebooks run
                # in a real kernel (tests/test_notebooks.py); scipy 1.11 for ttest_ind's df
                "pandas>=2", "matplotlib>=3.8", "tensorboard>=2.16", "tqdm>=4.66",
                "scipy>=1.11", "jupytext>=1.16", "nbclient>=0.10", "ipykernel>=6.29"],
        # sao_jax.lab: results of runs as DataFrames, plots, progress bars in notebooks, the
        # verdicts' t-tests (scipy); the notebooks (experiments/notebooks) are jupytext percent
        # files
        "lab": ["pandas>=2", "matplotlib>=3.8", "tensorboard>=2.16", "tqdm>=4.66",
                "scipy>=1.11", "jupytext>=1.16", "nbclient>=0.10", "ipykernel>=6.29"],
        # mini-swe-agent, run unmodified against the recording proxy (rollout.proxy)
        "swe-agent": ["mini-swe-agent>=2.0,<3"],
        # a real SGLang server on a GPU host (docs/sglang.md, "Real SGLang servers on a GPU
        # host"); it pins its own torch (CUDA), so install it in the GPU host's environment, not
        # beside the dev extra
        "sglang": ["sglang>=0.5.2,<0.6"],
        # a TPU VM, or `make plan` (libtpu compiles for a TPU topology from any host)
        "tpu": [f"jax[tpu]>={JAX_FLOOR}"],
        "cuda": [f"jax[cuda12]>={JAX_FLOOR}"],
        # `make test-gpu-compile`'s virtualenv, .venv-gpu: what tests/kernels needs to run, and
        # ptxas (the CUDA plugin, pinned to jaxlib's version, comes from the Makefile)
        "gpu-compile": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100",
                        "nvidia-cuda-nvcc-cu12"],
        # `make test-jax-floor`'s virtualenv, .venv-jax-floor (jax and jaxlib at JAX_FLOOR come
        # from the Makefile): what its tests need besides the project
        "jax-floor": ["pytest>=8", "pytest-xdist>=3.5", "pytest-timeout>=2.3", "hypothesis>=6.100",
                      "chex>=0.1.88"],
    },
)
