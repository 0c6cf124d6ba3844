"""What the P/D router's hop costs: the simulator validation's held-out cluster (one prefill
and one decode server with NixlConnector, `wideserve router`; benchmarks/sim_validate_pd.py)
benchmarked through the router and straight at the decode server, alternating. Straight at
the decode server a request carries no KV handle, so that server prefills it itself: TPOT
compares the relay, TTFT compares P/D's whole handoff against a colocated prefill. Each run
also reads both servers' engine counters (/metrics: steps and step seconds), so the decode
engine's own step inside the cluster sits beside the step the simulator calibrates alone.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/pd/router_hop.py OUT.json [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sim_validate_pd import bench, start_cluster, stop_cluster  # noqa: E402
from wideserve.sim.calibrate_pd import _served_counters  # noqa: E402

WORKLOAD = {"input_len": 256, "output_len": 32, "requests": 16, "concurrency": 4}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=8511)
    args = ap.parse_args()
    procs, router = start_cluster(args.port)
    prefill, decode = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.port + 1}"
    rows = []
    try:
        bench(router, WORKLOAD)                                  # warm-up, both legs
        for rnd in range(args.rounds):
            for name, url in (("router", router), ("decode_direct", decode)):
                before = [_served_counters(u) for u in (decode, prefill)]
                r = bench(url, WORKLOAD)
                (ds, de), (ps, pe) = [(s1 - s0, e1 - e0) for (s0, e0), (s1, e1) in
                                      zip(before, (_served_counters(decode),
                                                   _served_counters(prefill)))]
                rows.append({"round": rnd, "target": name, **r, "decode_steps": ds,
                             "decode_engine_s": de, "prefill_steps": ps,
                             "prefill_engine_s": pe})
                print(f"round {rnd} {name:13s} {r['output_tok_s']:7.1f} tok/s  TTFT p50 "
                      f"{r['ttft_p50_s'] * 1e3:6.1f} ms  TPOT p50 {r['tpot_p50_s'] * 1e3:5.2f} "
                      f"ms  decode engine {ds:.0f} steps {1e3 * de / max(ds, 1):.2f} ms/step  "
                      f"prefill engine {ps:.0f} steps {pe:.3f} s", flush=True)
    finally:
        stop_cluster(procs)
    Path(args.out).write_text(json.dumps({"workload": WORKLOAD, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
