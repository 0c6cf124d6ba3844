"""Data-parallel flags (vLLM's spellings) for `serve`, `generate` and `bench`, and the
ParallelConfig they build. A bad combination is a one-line error naming the flag."""
from __future__ import annotations

import argparse
import re

from wideserve.config import ParallelConfig
from wideserve.config.arg_types import parse_port, parse_positive_float, parse_positive_int


def _rank(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    d = ParallelConfig()
    g = parser.add_argument_group("data parallel + expert parallel (DEP, docs/distributed.md)")
    g.add_argument("--data-parallel-size", "-dp", type=parse_positive_int, default=1,
                   help="engine-core ranks in total, over all nodes")
    g.add_argument("--data-parallel-size-local", type=parse_positive_int, default=None,
                   help="ranks started on this node (default: all of them)")
    g.add_argument("--data-parallel-start-rank", type=_rank, default=0,
                   help="the first rank on this node (with --headless on the other nodes)")
    g.add_argument("--data-parallel-address", default=d.data_parallel_address,
                   help="node 0's address: rendezvous and the engines' sockets")
    g.add_argument("--data-parallel-rpc-port", type=parse_port, default=d.data_parallel_rpc_port,
                   help="rendezvous port on node 0; ranks on other nodes also use the "
                        "2 x size ports after it")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="shard the routed experts over the ranks (all-to-all MoE, lock-step)")
    g.add_argument("--dp-sync-timeout", type=parse_positive_float, default=d.dp_sync_timeout_s,
                   help="seconds a rank may stay silent before the group fails")
    g.add_argument("--dp-sync-method", default="auto", choices=("auto", "gloo", "rd"),
                   help="per-step sync: gloo all-reduce, recursive doubling on sockets, or "
                        "the faster one measured at start-up")


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    size = getattr(args, "data_parallel_size", 1)
    if getattr(args, "headless", False) and size == 1:
        raise ValueError("--headless needs --data-parallel-size > 1")
    parallel = ParallelConfig(
        data_parallel_size=size,
        data_parallel_size_local=getattr(args, "data_parallel_size_local", None),
        data_parallel_start_rank=getattr(args, "data_parallel_start_rank", 0),
        data_parallel_address=getattr(args, "data_parallel_address", "127.0.0.1"),
        data_parallel_rpc_port=getattr(args, "data_parallel_rpc_port", 29550),
        enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
        dp_sync_timeout_s=getattr(args, "dp_sync_timeout", 120.0),
        dp_sync_method=getattr(args, "dp_sync_method", "auto"))
    if not getattr(args, "headless", False) and parallel.data_parallel_start_rank != 0:
        raise ValueError("--data-parallel-start-rank: the node with the API server runs "
                         "rank 0 (start the other nodes with --headless)")
    try:
        parallel.check()
    except ValueError as e:
        raise ValueError(_as_flags(str(e))) from None
    return parallel


def _as_flags(message: str) -> str:
    """ParallelConfig's field names -> the flags that set them."""
    message = message.replace("dp_sync_timeout_s", "--dp-sync-timeout")
    return re.sub(r"\bdata_parallel_\w+", lambda m: "--" + m.group(0).replace("_", "-"),
                  message)
