"""Step phases at batch 64 where speculation drafts nothing (BENCHMARKS.md, "Speculation at
draft depth 0").

  OMP_NUM_THREADS=1 PYTHONPATH=ROOT python benchmarks/history/spec_depth0_phases.py ROOT

ROOT: the source tree to measure (the repository, or a `git archive` of an older commit, so
before and after run the same script). On the bundled model, 64 requests (benchmarks/
spec_decode.py's prompts), no speculation vs MTP k = 3 at the CPU's default depth per batch
size (0 drafts at batch 64); three interleaved runs each. Prints one JSON line: per config,
the median per step of the process CPU time and of each StepTimer phase, in ms.
"""
import json
import statistics
import sys

import torch

root = sys.argv[1]
sys.path.insert(0, root + "/benchmarks")
sys.path.insert(0, root + "/tools")
import spec_decode as sd  # noqa: E402
from tiny_data import held_out_stream  # noqa: E402

from wideserve.bench.report import BUNDLED_MODEL_DIR  # noqa: E402

torch.set_num_threads(1)
stream = held_out_stream(str(BUNDLED_MODEL_DIR))
prompts = sd._prompts(stream, 64, offset=32)
names = ("none", "mtp_k3")
llms = {n: sd._llm(sd.ACCEPTANCE[n], 64) for n in names}
res: dict[str, list[dict]] = {n: [] for n in names}
for _ in range(3):
    for n, llm in llms.items():
        st = llm.engine.timer.stats
        s0, k0 = dict(st.seconds), st.steps
        outs, (_, cpu), *_ = sd._generate(llm, prompts)
        k = st.steps - k0
        res[n].append({"cpu_ms_per_step": 1e3 * cpu / k,
                       **{p: 1e3 * (st.seconds[p] - s0[p]) / k for p in st.seconds}})
out = {n: {key: round(statistics.median(r[key] for r in rs), 3) for key in rs[0]}
       for n, rs in res.items()}
print(json.dumps({"code": root, **out}))
