from __future__ import annotations

import pytest
import torch

from p2ptrain.model import GPT, PRESETS, ModelConfig, preset


def test_presets_sizes() -> None:
    sizes = {}
    for name in PRESETS:
        with torch.device("meta"):
            sizes[name] = GPT(preset(name)).num_parameters()
    assert 150e3 <= sizes["micro"] <= 300e3
    assert 1e6 <= sizes["tiny"] <= 3e6
    assert 20e6 <= sizes["small"] <= 30e6
    assert 100e6 <= sizes["150m"] <= 160e6  # ~150M with a 32k vocabulary
    assert 1.0e9 <= sizes["1b"] <= 1.4e9


def test_forward_shape_and_loss() -> None:
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)
    m = GPT(cfg)
    x = torch.randint(0, 256, (3, 16))
    assert m(x).shape == (3, 16, 256)
    loss = m.loss(x, torch.randint(0, 256, (3, 16)))
    # Freshly initialised logits are near uniform: loss ≈ ln(256).
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.2


def test_causal_mask() -> None:
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)
    m = GPT(cfg).eval()
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10] = (y[:, 10] + 7) % 256  # change a future token
    with torch.no_grad():
        a, b = m(x), m(y)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_units_cover_parameters_once() -> None:
    for tied in (True, False):
        m = GPT(ModelConfig(d_model=32, n_layers=3, n_heads=2, seq_len=8, tie_embeddings=tied))
        units = m.units()
        assert [u for u, _ in units] == ["embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
        names = [n for _, ns in units for n in ns]
        assert sorted(names) == sorted(n for n, _ in m.named_parameters())
        assert len(names) == len(set(names))
        assert (dict(units)["head"] == []) == tied


def test_tied_embeddings_share_storage() -> None:
    m = GPT(ModelConfig(d_model=32, n_layers=1, n_heads=2, seq_len=8))
    assert m.head.weight is m.embed.weight


def test_bad_configs() -> None:
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="positive"):
        ModelConfig(n_layers=0)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("huge")
    m = GPT(ModelConfig(d_model=32, n_layers=1, n_heads=2, seq_len=8))
    with pytest.raises(ValueError, match="longer than"):
        m(torch.zeros(1, 9, dtype=torch.long))
