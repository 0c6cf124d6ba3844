"""C++ CPU kernels, built once per machine as one JIT extension (docs/cpu_kernels.md).

`loader.cpu_ops_available()` builds/loads `wideserve_cpu_ops` from `csrc/*.cpp`; its ops are
then reachable as `torch.ops.wideserve.<op>`. CUDA never uses them.
"""
