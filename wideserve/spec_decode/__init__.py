"""Speculative decoding (docs/design.md, "Speculative decoding").

    config.py             SpeculativeConfig (vLLM's --speculative-config JSON)
    proposer.py           Proposer interface + ProposeInput (what a step hands a proposer)
    mtp.py                MTPProposer: the checkpoint's MTP block, k steps, own window cache
    ngram.py              NgramProposer: prompt lookup, no model
    draft_model.py        DraftModelProposer: a smaller wideserve model, KV in the same manager
    rejection_sampler.py  RejectionSampler: greedy match / lossless speculative sampling
    metrics.py            SpecDecodeStats (EngineStats.spec_decode; vLLM's spec_decode_* names)
    decoder.py            SpecDecoder: the engine core's glue (verify, propose, commit)

Kept light: importing the package imports nothing heavy (the CLI parses SpeculativeConfig).
"""
