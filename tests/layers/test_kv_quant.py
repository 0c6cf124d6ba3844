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
    x[2] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * (width // 8))  # ties
    return x


@pytest.mark.parametrize("fmt,group", [("fp8", 32), ("nvfp4", 16), ("mxfp4", 32)])
@pytest.mark.parametrize("width", [64, 512])
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
    with pytest.raises(ValueError, match="divisible by 16"):
        kv_quant.record_bytes("nvfp4", 40)
    with pytest.raises(ValueError, match="unknown KV record format"):
        kv_quant.fake_quant(torch.zeros(2, 32), "int4")
