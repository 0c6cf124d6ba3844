"""The first constrained request costs the engine's step loop nothing (issue 25).

It used to stall every running stream by ~0.9 s: the engine thread imported
`llguidance.torch` at the first mask (its torch.compile decorator loads torch's compiler
stack), and the llguidance tokenizer was built then too (imports on a compile thread that
competed with the step for the GIL). Checked without timing: in a fresh interpreter (module
imports happen once per process), the llguidance set-up is done at start-up, and the engine
thread imports no module while it serves the first constrained request.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, threading, warnings
from wideserve import LLM, SamplingParams
from wideserve.types.structured_params import StructuredOutputsParams as SO

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    llm = LLM(None, dtype="float32", device="cpu")
manager = llm.engine.structured
warm_up = getattr(manager, "warm_up", None)
if warm_up is not None:
    warm_up.result(120)
set_up_at_start = manager._lltok is not None
# Unconstrained sampling first: whatever it imports lazily is not the grammar's doing.
free = SamplingParams(temperature=1.0, seed=3, max_tokens=4)
llm.generate(["HAMLET.\n"], free, use_tqdm=False)

engine_thread = threading.get_ident()
imported = []

class Recorder:
    # Asked first for every module not imported yet; finds nothing, records who asked.
    def find_spec(self, name, path=None, target=None):
        if threading.get_ident() == engine_thread:
            imported.append(name)
        return None

sys.meta_path.insert(0, Recorder())
so = SamplingParams(temperature=1.0, seed=3, max_tokens=4,
                    structured_outputs=SO(json='{"type": "string", "enum": ["yes", "no"]}'))
out = llm.generate(["HAMLET.\n"], so, use_tqdm=False)[0].outputs[0]
sys.meta_path.pop(0)
print("RESULT " + json.dumps({"set_up_at_start": set_up_at_start, "imported": imported,
                              "text": out.text, "finish": out.finish_reason}))
"""


def test_the_first_constrained_request_does_no_setup_on_the_engine_thread():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    assert got["text"] in ('"yes"', '"no"') and got["finish"] == "stop", got
    assert got["set_up_at_start"], "the llguidance tokenizer was not built at start-up"
    assert got["imported"] == [], \
        f"the engine thread imported {got['imported']} serving the first constrained request"
