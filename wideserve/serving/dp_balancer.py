"""Which data-parallel rank gets a new request (docs/distributed.md, "Front end").

Load score per rank = in-flight requests (exact: the front end counts what it sent and what
finished) + 3 x the waiting requests of the rank's latest stats snapshot (so a queued request
counts 4x, as vLLM scores waiting*4 + running) + its KV-cache usage (0-1, breaks ties toward
the emptier cache). The least loaded rank wins; ties go to the lowest rank.

Prefix affinity (optional): a prompt's first full block hashes to a home rank; the request goes
home when the home's score is within `affinity_slack` of the best, so prompts sharing a prefix
meet on the rank that caches it. BENCHMARKS.md ("DEP front end") measures whether it helps.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class LoadBalancer:
    num_ranks: int
    prefix_affinity: bool = False
    affinity_block: int = 256              # tokens hashed for the home rank
    affinity_slack: float = 2.0
    in_flight: list[int] = field(default_factory=list)
    picks: list[int] = field(default_factory=list)
    affinity_hits: int = 0

    def __post_init__(self) -> None:
        self.in_flight = [0] * self.num_ranks
        self.picks = [0] * self.num_ranks

    def scores(self, stats: Sequence[dict[str, Any]]) -> list[float]:
        out = []
        for r in range(self.num_ranks):
            s = stats[r] if r < len(stats) else {}
            waiting = min(int(s.get("num_waiting", 0) or 0), self.in_flight[r])
            out.append(self.in_flight[r] + 3 * waiting + float(s.get("kv_usage", 0.0) or 0.0))
        return out

    def home(self, prompt_token_ids: Sequence[int]) -> int | None:
        if not self.prefix_affinity or len(prompt_token_ids) < self.affinity_block:
            return None
        head = ",".join(map(str, prompt_token_ids[:self.affinity_block])).encode()
        return int.from_bytes(hashlib.blake2b(head, digest_size=8).digest(), "little") \
            % self.num_ranks

    def pick(self, prompt_token_ids: Sequence[int], stats: Sequence[dict[str, Any]]) -> int:
        scores = self.scores(stats)
        best = min(range(self.num_ranks), key=lambda r: (scores[r], r))
        home = self.home(prompt_token_ids)
        if home is not None and scores[home] <= scores[best] + self.affinity_slack:
            if home != best:
                self.affinity_hits += 1
            best = home
        return best

    def sent(self, rank: int, num: int) -> None:
        self.in_flight[rank] += num
        self.picks[rank] += 1

    def finished(self, rank: int, num: int = 1) -> None:
        self.in_flight[rank] = max(0, self.in_flight[rank] - num)
