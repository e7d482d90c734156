"""Install the REFT pretraining system.

torch must already be installed (``pip install torch==2.13.0``); it is not listed in
install_requires on purpose so that pip never resolves a newer (CUDA) torch.
The native extension ``reft_ext._C`` is built when a C++ compiler exists and is
optional at run time (see csrc/).
"""

import os
import sys

from setuptools import find_packages, setup

# PEP 517 backends run this file without the project root on sys.path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:  # the extension build lives next to its sources
    from csrc.setup_ext import get_ext_modules, get_cmdclass
except Exception as exc:  # noqa: BLE001 - never fail the install because of _C
    print(f"[reft_ext] native extension disabled: {exc}")

    def get_ext_modules():
        return []

    def get_cmdclass():
        return {}


setup(
    name="reft-megatron",
    version="0.1.0",
    description="Megatron-core Llama pretraining with REFT in-memory fault tolerance",
    # megatron/ has no __init__.py (megatron-core owns the namespace): name megatron.training
    packages=find_packages(include=["reft_ext", "reft_ext.*"]) + ["megatron.training"],
    py_modules=["pretrain_llama"],
    python_requires=">=3.10",
    install_requires=[
        "megatron-core==0.16.1",
        "pybind11>=2.10",
        "numpy",
        "psutil",  # needed by megatron-core's dist_checkpointing writer, undeclared there
        "xxhash",  # snapshot checksums at ~10 GB/s
        "einops",  # megatron-core's partial distributed optimizer groups (hpZ), undeclared
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "hypothesis", "tensorboard", "matplotlib"],
        "plot": ["matplotlib"],
        "gpu": ["transformer-engine", "apex"],
        # real tokenizers (--tokenizer-type HuggingFaceTokenizer / SentencePieceTokenizer,
        # tools/train_tokenizer.py) and Hugging Face checkpoints; none of them pulls in torch
        "hf": ["transformers", "tokenizers", "sentencepiece", "safetensors"],
    },
    ext_modules=get_ext_modules(),
    cmdclass=get_cmdclass(),
)
