"""Multi-rank execution: process groups, data-parallel step sync, expert parallelism, EPLB."""
