"""wideserve: an inference and serving engine for DeepSeek-V4-family MoE models."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so `import wideserve` (and the CLI's --help) stays fast and torch-free.
    if name == "LLM":
        from wideserve.serving.llm import LLM
        return LLM
    if name == "SamplingParams":
        from wideserve.types.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
