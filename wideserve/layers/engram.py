"""Engram of DeepSeek-V4.1: n-gram memory rows gathered by hashed token ids (docs/deepseek_v41.md).

For the token at position p and each n = 2..N (N = engram_max_ngram_size), the n-gram ending at
p is hashed: its tokens, mapped to a normalised ("compressed") vocabulary, times per-layer odd
multipliers, XOR-chained; positions before the request's start count as the pad token. Each
(n, head) pair reduces the hash modulo its own prime (the next unused primes above
engram_vocab_size - 1) and adds an offset, giving (N-1) * heads row ids into one table.
The rows are flattened and projected by `wkv` to one key per residual stream plus one shared
value; stream k += sigmoid(signed sqrt(normalised <stream_k, key_k>)) * value.

The table is far larger than device memory in the real model (~384M rows x 256), so it lives
in host memory (`HostTable`: kept on the CPU whatever device the model moves to) and only the
rows a step needs are gathered and copied to the device.

Token history: the hash at p needs the tokens at p-N+1 .. p, which may belong to earlier
steps; the model keeps them in a small per-position sliding-window cache ("engram_tokens"), so
chunked prefill, decode, prefix caching and preemption see the same n-grams as one full pass.

A captured decode step (worker/decode_capture.py) cannot gather from host memory by row ids
the device computes: on CUDA that is a device-to-host read inside the forward. There the
rows are staged before the replay instead (`EngramStaging`): hashed on the host from token
ids the host already has (each request's tokens; the sampled ids are the step's one read),
gathered from the host table and copied into a static device buffer, which is all the
captured forward reads of Engram.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from torch import nn

from wideserve.kv_cache import host_memory
from wideserve.layers import quant


def compressed_token_map(tokenizer_json: str) -> tuple[list[int], int]:
    """Token id -> normalised-vocabulary id, from a tokenizer.json string.

    Each token is decoded alone and normalised (NFKC, NFD, accents stripped, lower case,
    whitespace runs collapsed to one space and stripped, a lone space kept); tokens that do not
    decode to valid text keep their own vocabulary string. Equal keys share one id, numbered
    in order of first appearance."""
    from tokenizers import Regex, Tokenizer, normalizers

    keep_space = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.Lowercase(), normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), keep_space), normalizers.Strip(),
        normalizers.Replace(keep_space, " ")])
    tok = Tokenizer.from_str(tokenizer_json)
    ids: dict[str, int] = {}
    out = []
    for token_id in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(token_id)
        else:
            key = norm.normalize_str(text) or text
        out.append(ids.setdefault(key, len(ids)))
    return out, len(ids)


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


class NgramHasher:
    """Row ids of every Engram layer's table for a batch of n-grams (host or device tensors).

    primes[l]: [(N-1) * heads] moduli; offsets[l]: their cumulative row offsets;
    multipliers[l]: [N] odd int64 factors from numpy's default_rng(10007 * layer)."""

    def __init__(self, layer_ids: Sequence[int], num_rows: Sequence[int], max_ngram: int,
                 n_heads: int, bucket_base: int, compressed_vocab: int, pad_id: int) -> None:
        self.max_ngram = max_ngram
        self.n_heads = n_heads
        self.pad_id = pad_id
        bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
        seen: set[int] = set()
        primes, offsets, mults = [], [], []
        for layer, rows in zip(layer_ids, num_rows):
            layer_primes = []
            for _ in range(max_ngram - 1):
                p = bucket_base - 1
                for _ in range(n_heads):
                    p += 1
                    while not _is_prime(p) or p in seen:
                        p += 1
                    seen.add(p)
                    layer_primes.append(p)
            if sum(layer_primes) > rows:
                raise ValueError(f"Engram layer {layer}: its hash buckets need "
                                 f"{sum(layer_primes)} table rows, the table has {rows}")
            primes.append(layer_primes)
            offsets.append(np.cumsum([0, *layer_primes[:-1]]).tolist())
            draw = np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,),
                                                                  dtype=np.int64)
            mults.append((draw * 2 + 1).tolist())
        self.primes = torch.tensor(primes, dtype=torch.int64)        # [L, (N-1)*heads]
        self.offsets = torch.tensor(offsets, dtype=torch.int64)
        self.multipliers = torch.tensor(mults, dtype=torch.int64)     # [L, N]
        self._on_device: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(multipliers, primes, offsets) on `device`, copied once: a per-step copy from the
        host is what a captured decode graph must not contain (docs/cuda_graphs.md)."""
        tables = self._on_device.get(device)
        if tables is None:
            tables = self._on_device[device] = (self.multipliers.to(device),
                                                self.primes.to(device), self.offsets.to(device))
        return tables

    def __call__(self, grams: torch.Tensor, layer: int) -> torch.Tensor:
        """grams [T, N] compressed ids of positions p, p-1, .., p-N+1 (pad_id where blocked)
        -> row ids [T, (N-1) * heads] of table `layer` (index into the hasher's layers)."""
        multipliers, primes, offsets = self._tables(grams.device)
        products = grams * multipliers[layer]
        rolling = products[:, 0]
        out = []
        primes = primes[layer].view(self.max_ngram - 1, self.n_heads)
        for shift in range(1, self.max_ngram):
            rolling = torch.bitwise_xor(rolling, products[:, shift])
            out.append(rolling[:, None] % primes[shift - 1])
        return torch.cat(out, dim=-1) + offsets[layer]


class HostResident:
    """Marks a module whose parameters the loader allocates in host memory
    (worker/model_loader.py), whatever the model's device; it gathers rows itself."""

    # Whether its tables ask for 2 MiB pages (kv_cache/host_memory.py, huge_page_empty).
    huge_pages: bool = True

    def allocate_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory for one of its parameters (the loader calls this instead of
        torch.empty): on transparent huge pages where the OS allows and `huge_pages`. Random
        row reads over a table of many GB miss the TLB on almost every row with 4 KiB
        pages; with 2 MiB pages its page entries are 512x fewer."""
        if not self.huge_pages:
            return torch.empty(shape, dtype=dtype)
        return host_memory.huge_page_empty(tuple(shape), dtype, type(self).__name__)[0]


class HostTable(HostResident, nn.Module):
    """An embedding table that stays in host memory (`weight` [rows, dim]); `gather(ids)`
    reads rows by id on the host and returns them on the ids' device. An official FP8
    checkpoint's table stays FP8 (e4m3 rows, one UE8M0 scale per row and 32 channels: a
    quarter of the fp32 bytes) and only the gathered rows are dequantised."""

    SCALE_GROUP = 32        # channels per scale of an FP8 table

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)
        self.register_buffer("scale", None, persistent=False)   # [rows, dim / 32] (FP8)

    def load_fp8(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Keep an FP8 e4m3 table [>= rows, dim] with its scales [>= rows, dim / 32] (rows past
        the config's count are the checkpoint's padding)."""
        rows, dim = self.weight.shape
        grid = (rows, -(-dim // self.SCALE_GROUP))
        if weight.dtype != torch.float8_e4m3fn or weight.shape[0] < rows or \
                weight.shape[1] != dim or scale.shape[0] < rows or scale.shape[1] != grid[1]:
            raise ValueError(f"FP8 Engram table {tuple(weight.shape)} {weight.dtype} with scales "
                             f"{tuple(scale.shape)}: expected float8_e4m3fn [{rows}, {dim}] and "
                             f"scales [{rows}, {grid[1]}]")
        self.weight = nn.Parameter(self._on_host(weight[:rows]), requires_grad=False)
        self.scale = self._on_host(scale[:rows])

    def _on_host(self, t: torch.Tensor) -> torch.Tensor:
        """t in host memory from `allocate_host` (a copy: the checkpoint's tensor is on
        ordinary pages), or t itself on the CPU where that gives no huge pages."""
        if self.huge_pages:
            home, huge = host_memory.huge_page_empty(tuple(t.shape), t.dtype,
                                                     type(self).__name__)
            if huge:
                return home.copy_(t)
        return t.to("cpu")

    def _apply(self, fn, recurse: bool = True):   # noqa: ANN001 - nn.Module's signature
        # Moving the model (to a GPU, or to another dtype) leaves the table where it is:
        # only the rows a step gathers travel. An FP8 table also keeps its storage dtype.
        # (nn.Module._apply may swap a parameter's .data in place: keep the tensors.)
        weight, scale = self.weight.data, self.scale
        super()._apply(fn, recurse)
        if self.weight.device.type != "cpu" or scale is not None:
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.scale = scale
        return self

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(self.weight.device)
        if self.scale is None:
            rows = self.weight.index_select(0, flat)
        else:   # byte views: index_select on the float8 dtypes is not available everywhere
            codes = self.weight.view(torch.uint8).index_select(0, flat)
            scales = self.scale.view(torch.uint8).index_select(0, flat)
            rows = quant.dequantize_fp8_block(codes.view(self.weight.dtype),
                                              scales.view(self.scale.dtype),
                                              (1, self.SCALE_GROUP), torch.float32)
        return rows.view(*ids.shape, -1).to(ids.device, non_blocking=True)


class EngramStaging:
    """The Engram rows of a captured decode step of up to `max_rows` rows, per Engram layer,
    staged before the replay into one static buffer [max_rows, layers, hash_heads, dim]
    (fp32: a dequantised FP8 row's dtype, exact for bf16 / fp16 tables). On CUDA a pinned
    host copy uploaded with non_blocking (one copy suffices: the next step writes it only
    after this step's sampled tokens were read back), on the CPU the buffer itself."""

    def __init__(self, key: str, hasher: NgramHasher, token_map: np.ndarray,
                 tables: Sequence[HostTable], max_rows: int, device: torch.device) -> None:
        """key: the ForwardBatch.extras name the model reads the rows under."""
        self.key, self.hasher, self.token_map = key, hasher, token_map
        self.tables = list(tables)
        heads, dim = hasher.n_heads * (hasher.max_ngram - 1), tables[0].weight.shape[1]
        shape = (max_rows, len(self.tables), heads, dim)
        self.host = torch.zeros(shape, dtype=torch.float32, pin_memory=device.type == "cuda")
        self.dev = self.host if device.type == "cpu" else \
            torch.zeros(shape, dtype=torch.float32, device=device)

    def grams(self, tokens: Sequence[int], positions: Sequence[int],
              contexts: Sequence[Sequence[int]], n: int) -> np.ndarray:
        """[n, N] normalised ids of the n-gram ending at each row's new token (tokens[r] at
        positions[r], after contexts[r][:positions[r]]), the decode path's rule: positions
        below 0 are the pad id; rows past len(tokens) are padding (token 0 at position 0)."""
        N = self.hasher.max_ngram
        raw = np.full((n, N), -1, dtype=np.int64)          # -1: before the request's start
        raw[:, 0] = 0
        for r, (tok, p, ctx) in enumerate(zip(tokens, positions, contexts)):
            if len(ctx) < p:
                raise ValueError(f"Engram staging: row {r} at position {p} came with "
                                 f"{len(ctx)} tokens of history (StepRequest.context)")
            raw[r, 0] = tok
            lo = max(p - N + 1, 0)
            raw[r, 1:1 + p - lo] = ctx[lo:p][::-1]
        mapped = self.token_map[np.clip(raw, 0, len(self.token_map) - 1)]
        return np.where(raw < 0, self.hasher.pad_id, mapped)

    def stage(self, tokens: Sequence[int], positions: Sequence[int],
              contexts: Sequence[Sequence[int]], n: int) -> None:
        """Hash, gather and upload rows [:n] (see `grams`)."""
        grams = torch.from_numpy(self.grams(tokens, positions, contexts, n))
        for i, table in enumerate(self.tables):
            self.host[:n, i] = table.gather(self.hasher(grams, i))
        if self.dev is not self.host:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)

    def inputs(self, n: int) -> dict[str, torch.Tensor]:
        """The batch's extras: the first n rows' staged rows, [n, layers, hash_heads, dim]
        on the device (a view: the same address every step)."""
        return {self.key: self.dev[:n]}


class Engram(nn.Module):
    """Names (the reference's): embed.weight (HostTable), wkv, q_weight, k_weight."""

    def __init__(self, hidden: int, hc_mult: int, num_rows: int, head_dim: int,
                 hash_heads: int, eps: float) -> None:
        super().__init__()
        self.hidden = hidden
        self.hc_mult = hc_mult
        self.eps = eps
        self.embed = HostTable(num_rows, head_dim)
        self.wkv = nn.Linear(hash_heads * head_dim, hidden * (hc_mult + 1), bias=False)
        self.q_weight = nn.Parameter(torch.empty(hc_mult, hidden))
        self.k_weight = nn.Parameter(torch.empty(hc_mult, hidden))

    def forward(self, streams: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """streams [T, n, d], row_ids [T, hash_heads] -> streams [T, n, d]. row_ids may
        instead be the rows already gathered, [T, hash_heads, dim] floating point (a
        captured decode step's, EngramStaging)."""
        rows = row_ids if row_ids.is_floating_point() else self.embed.gather(row_ids)
        rows = rows.flatten(-2).to(streams.dtype)
        key, value = self.wkv(rows).split((self.hc_mult * self.hidden, self.hidden), dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.hidden))            # [T, n, d]
        h = streams.float()
        weights = self.q_weight.float() * self.k_weight.float()
        rstd = (torch.rsqrt(h.square().mean(-1) + self.eps)
                * torch.rsqrt(key.square().mean(-1) + self.eps))
        dot = (h * weights * key).sum(-1) * rstd * self.hidden ** -0.5          # [T, n]
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
