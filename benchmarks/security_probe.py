"""Hostile-client and fault probe of the server, the router and a P/D pair (issue 25).

Replays every item of issue 25 on loopback against real processes (the bundled model, CPU)
and prints one row per case: the attack or fault, what is expected, what was observed, PASS
or FAIL; then a summary table of the totals the issue asks for, each against its goal: cases
passed (hostile ones among them), processes left behind, the longest stall (gap between two
tokens) of an unrelated stream that runs on the attacked server throughout, unexpected 5xx
answers (to hostile requests; a 5xx a case expects, such as the router's /health 503 with no
decode server, is its case's result, not counted), and bytes of another request's KV
obtained. Exit status 0 only if every line passes.

Every case has its own timeout; a case that times out or raises is a FAIL with the reason,
and the next one runs (a server left unresponsive is restarted first). Everything started
here carries WIDESERVE_PROBE=<our pid> in its environment and is killed at the end.

    PYTHONPATH=. python benchmarks/security_probe.py [--quick] [--only server,pd,faults]

--quick shrinks the big bodies (a few minutes on 2 cores); the default uses the issue's sizes.
The cases are in security_probe_server.py (one API server) and security_probe_pd.py (P/D pair,
router, process faults); the processes, the watched stream and the timeouts in
security_probe_harness.py.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys

from security_probe_harness import (
    API_KEY, FULL, MODEL, QUICK, Row, STALL_GOAL_S, Server, Sizes, StreamWatch, TOTALS,
    free_port, kill_all, ours, run_case, wait_gone)
from security_probe_pd import PD, dep_stopped_rank, pd_cases, sigkilled_server
from security_probe_server import server_cases


# -------------------------------------------------------------------------------- report

def report() -> int:
    rows = TOTALS.rows
    w = [max([len(r.case) for r in rows] + [15]), max([len(r.expected) for r in rows] + [8])]
    print()
    print(f"{'attack or fault':<{w[0]}} | {'expected':<{w[1]}} | result | stream gap | observed")
    print("-" * (w[0] + w[1] + 40))
    for r in rows:
        gap = f"{r.gap_s * 1000:7.0f} ms" if r.gap_s is not None else " " * 10
        print(f"{r.case:<{w[0]}} | {r.expected:<{w[1]}} | {'PASS' if r.passed else 'FAIL':<6} "
              f"| {gap} | {r.observed}")
    gaps = [r.gap_s for r in rows if r.gap_s is not None]
    hostile = [r for r in rows if r.hostile]
    passed = sum(r.passed for r in rows)
    longest = max(gaps) if gaps else 0.0
    summary = [
        ("cases passed", f"{passed} of {len(rows)} ({len(hostile)} hostile)", "all",
         passed == len(rows)),
        ("processes left behind", f"{TOTALS.procs_left}", "0", TOTALS.procs_left == 0),
        ("longest stall of an unrelated running stream",
         f"{longest * 1000:.0f} ms" if gaps else "(no stream watched)",
         f"< {STALL_GOAL_S * 1000:.0f} ms", longest < STALL_GOAL_S),
        ("unexpected 5xx answers", f"{TOTALS.five_xx}", "0", TOTALS.five_xx == 0),
        ("bytes of another request's KV obtained", f"{TOTALS.kv_bytes_stolen:.0f}", "0",
         TOTALS.kv_bytes_stolen == 0),
    ]
    print()
    w = max(len(s[0]) for s in summary)
    print(f"{'summary':<{w}} | {'observed':<22} | {'goal':<8} | result")
    print("-" * (w + 45))
    for what, observed, goal, ok in summary:
        print(f"{what:<{w}} | {observed:<22} | {goal:<8} | {'PASS' if ok else 'FAIL'}")
    return 0 if all(ok for *_, ok in summary) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller bodies, shorter timeouts")
    ap.add_argument("--only", default="server,pd,faults",
                    help="comma-separated sections: server, pd, faults")
    args = ap.parse_args()
    sizes = QUICK if args.quick else FULL
    sections = set(args.only.split(","))
    print(f"security probe ({'quick' if args.quick else 'full'} sizes), sections "
          f"{sorted(sections)}; load {os.getloadavg()[0]:.1f}", flush=True)
    started: list[Server] = []
    try:
        if "server" in sections or "faults" in sections:
            srv = Server("serve", ["--served-model-name", MODEL, "--log-level", "info",
                                   "--api-key", API_KEY], key=API_KEY)
            started.append(srv)
        if "server" in sections:
            print("API server: hostile requests while a stream runs", flush=True)
            watch = StreamWatch(srv.url, srv.headers)
            try:
                server_cases(srv, sizes, watch)
            finally:
                watch.close()
        if "pd" in sections:
            print("P/D pair behind the router", flush=True)
            _pd_section(sizes, started)
        if "faults" in sections:
            print("process faults", flush=True)
            run_case(Row("DEP2 rank SIGSTOPped (heartbeat 2 s, stall 5 s)",
                         "/health fails < 10 s, stream error < 20 s", hostile=False),
                     lambda: dep_stopped_rank(40.0), 400)
            run_case(Row("server SIGKILLed", "no child left after 5 s", hostile=False),
                     lambda: sigkilled_server(srv), 30)
    finally:
        for s in started:
            s.stop()
        left = wait_gone(ours(), 10.0)
        TOTALS.procs_left = len(left)
        kill_all(left)
    return report()


def _pd_section(sizes: Sizes, started: list[Server]) -> None:
    env = {"WIDESERVE_KV_SECRET": secrets.token_hex(24)}
    common = ["--served-model-name", MODEL, "--log-level", "warning", "--api-key", API_KEY]
    try:
        prefill = Server("serve", [*common, "--kv-transfer-config", json.dumps(
            {"kv_connector": "NixlConnector", "kv_role": "kv_producer"})], env, key=API_KEY)
        started.append(prefill)
        decode = Server("serve", [*common, "--kv-transfer-config", json.dumps(
            {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
             "kv_load_failure_policy": "fail"})], env, key=API_KEY)
        started.append(decode)
        router = Server("router", ["--prefill", prefill.url, "--decode", decode.url,
                                   "--log-level", "warning"], env)
        started.append(router)
        router_no_prefill = Server("router", [
            "--prefill", f"http://127.0.0.1:{free_port()}", "--decode", decode.url,
            "--log-level", "warning"], env, ready_any_status=True)
        started.append(router_no_prefill)
    except RuntimeError as e:
        run_case(Row("P/D pair start-up", "starts"), lambda: (str(e)[:200], False), 5)
        return
    pd_cases(PD(prefill, decode, router, router_no_prefill, sizes.case_timeout_s,
                env["WIDESERVE_KV_SECRET"].encode()), sizes)


if __name__ == "__main__":
    sys.exit(main())
