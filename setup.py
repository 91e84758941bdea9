"""dpo-megatron: a Megatron-style 3D-parallel DPO training engine."""

from setuptools import find_packages, setup

setup(
    name="dpo-megatron",
    version="0.1.0",
    description="3D-parallel Direct Preference Optimization (DPO family) on megatron-core",
    packages=find_packages(include=["dpo_megatron", "dpo_megatron.*"]),
    python_requires=">=3.11",
    install_requires=[
        # CPU machines: `pip install torch==2.13.0` first (a local CPU wheel); GPUs: any >= 2.6.
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",
        "sentencepiece",
        "datasets",
        "transformers",
        "safetensors",
        "omegaconf>=2.4",  # PEP 604 unions (int | None) in structured configs
        "tensorboard",
        "numpy",
        # An online run's evaluation plot (dpo_megatron/online/evaluation.py).
        "matplotlib>=3.8",
        # Checkpoint manifests: XXH3-128 checksums (dpo_megatron/checkpointing/integrity.py).
        "xxhash>=3",
    ],
    extras_require={
        # peft: the LoRA export test loads the adapters with peft.PeftModel.from_pretrained;
        # beautifulsoup4: the StackExchange preprocessing tests (the "reference" extra);
        # pytest-xdist: the suite runs on two workers (README's test command);
        # ruff and import-linter: the style and layering checks (tests/test_style.py).
        "test": [
            "pytest",
            "pytest-xdist",
            "peft",
            "beautifulsoup4",
            "ruff>=0.17,<0.18",
            "import-linter>=2",
        ],
        # NVIDIA apex is optional and detected at run time; the PyPI package named `apex` is an
        # unrelated project and must never be listed here.
        "gpu": ["transformer-engine[pytorch]"],
        "convert": ["gguf", "accelerate", "peft"],
        # scripts/bench_dpo.py: TRL's DPOTrainer side by side (tested with trl 1.16.0).
        "bench": ["trl>=1.16", "matplotlib>=3.8"],  # matplotlib: scripts/bench_curve.py
        # data.reference_preprocessing on StackExchange rows: the reference DPO repo strips their
        # HTML with BeautifulSoup's html.parser; the same parser gives the same text.
        "reference": ["beautifulsoup4"],
    },
)
