"""DeepSeek-V4.1 KV record quantisers, bit for bit against the reference's (nemo-automodel
0.7.0 quantize_cache): quantise-dequantise and pack -> unpack round trips on random data over
scales from 1e-7 to 1e3, with zeros, exact ties and clamped values."""
from __future__ import annotations

import pytest
import torch

from wideserve.layers import kv_quant


def _data(width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(width)
    rows = [torch.randn(64, width, generator=g) * s for s in (1e-7, 1e-3, 0.1, 1.0, 30.0, 1e3)]
    x = torch.cat(rows)
    x[0] = 0.0
    x[1, :7] = 0.0
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * -(-width // 8))
    x[2] = ties[:width]
    return x


# 48, 40, 17: widths that are not whole groups; the reference zero-pads the last group.
@pytest.mark.parametrize("fmt,group", [("fp8", 32), ("nvfp4", 16), ("mxfp4", 32)])
@pytest.mark.parametrize("width", [64, 512, 48, 40, 17])
def test_round_trips_equal_the_reference(fmt, group, width):
    from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache
    x = _data(width)
    ref = quantize_cache(x, format=fmt, block_size=group)
    assert torch.equal(kv_quant.fake_quant(x, fmt), ref)
    records = kv_quant.pack(x, fmt)
    assert records.dtype == torch.uint8
    assert records.shape == (x.shape[0], kv_quant.record_bytes(fmt, width))
    assert torch.equal(kv_quant.unpack(records, fmt, width), ref)


def test_record_sizes_and_errors():
    assert kv_quant.record_bytes("fp8", 512) == 528       # window latent
    assert kv_quant.record_bytes("nvfp4", 512) == 288     # compressed entry
    assert kv_quant.record_bytes("mxfp4", 128) == 68      # indexer key
    # A partial last group keeps its own scale; e2m1 codes of an odd width end in one zero
    # nibble. kv_cache/spec.py sizes the cache records the same way.
    from wideserve.kv_cache.spec import record_bytes as spec_bytes
    assert kv_quant.record_bytes("fp8", 48) == 48 + 2
    assert kv_quant.record_bytes("nvfp4", 40) == 20 + 3
    assert kv_quant.record_bytes("mxfp4", 17) == 9 + 1
    for fmt, spec in (("fp8", "fp8_ue8m0"), ("nvfp4", "nvfp4_ds_mla"), ("mxfp4", "mxfp4_index")):
        for width in (17, 40, 48, 512):
            assert kv_quant.record_bytes(fmt, width) == spec_bytes(spec, width, torch.uint8, 0)
    with pytest.raises(ValueError, match="positive width"):
        kv_quant.record_bytes("fp8", 0)
    with pytest.raises(ValueError, match="unknown KV record format"):
        kv_quant.fake_quant(torch.zeros(2, 32), "int4")
