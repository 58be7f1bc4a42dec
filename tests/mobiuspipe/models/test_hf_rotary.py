"""The Llama family's rotary tables in a pipeline layer: made without a host read in the forward (on CUDA each is a
wait for the compute stream) and kept per device without moving the one another device uses."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mobiuspipe.models.hf import DecoderLayer, layer_factories, open_hf

VOCAB = 301  # hf_fixtures.VOCAB


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's value on the host (on CUDA: a wait for the stream that computes it)."""

    READS = (
        torch.Tensor.__bool__,
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__float__,
        torch.Tensor.__int__,
    )

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "scaling", [None, {"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}]
)
def test_a_decoder_layer_reads_nothing_on_the_host(tmp_path, hf_kit, scaling):
    """transformers' dynamic rope compares max(position_ids) + 1 with its cached length twice a forward; a pipeline
    run never passes max_position_embeddings (open_hf refuses it), where dynamic rope is the default one, so its
    tables are the same and the layer gives transformers' logits."""
    over = {} if scaling is None else {"rope_scaling": scaling}
    model = hf_kit.save_model("llama", tmp_path / "m", seed=5, **over).eval()
    m = open_hf(tmp_path / "m", 17)
    layers = [f() for f in layer_factories(m)]
    x = torch.randint(0, VOCAB, (2, 17))
    reads = HostReads()
    with torch.no_grad():
        hidden = layers[0](x)
        with reads:
            for layer in layers[1:-1]:
                hidden = layer(hidden)
        got = layers[-1](hidden)
        want = model(x).logits
    assert reads.count == 0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_the_rotary_kept_for_another_device_is_a_copy(tmp_path, hf_kit):
    hf_kit.save_model("llama", tmp_path / "m", seed=5)
    layer = layer_factories(open_hf(tmp_path / "m", 17))[1]()
    assert isinstance(layer, DecoderLayer)
    layer._rotary_on(torch.device("meta"))  # meta stands for cuda:g
    assert all(b.device.type == "cpu" for b in layer._rotary_on(torch.device("cpu")).buffers())
    assert all(b.device.type == "meta" for b in layer._rotary_on(torch.device("meta")).buffers())
