"""transformers' convolutional image classifiers, built from small configs (no weights): ResNet
(basic and bottleneck blocks: convolutions, batch norm in training, max pooling, adaptive
average pooling) and ConvNeXt (depthwise 7x7 convolutions, channels-last LayerNorm, GELU, layer
scale) train 2 SGD-with-momentum steps like eager in float64 on the reference backend: the loss
(transformers' own cross-entropy), every parameter and every buffer (the running statistics)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from train_like_eager import assert_trains_like_eager

transformers = pytest.importorskip("transformers")


def _resnet(layer_type: str):
    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                       layer_type=layer_type, num_labels=4)  # fmt: skip
    return transformers.ResNetForImageClassification(config)


def _convnext():
    config = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=4)
    return transformers.ConvNextForImageClassification(config)


MODELS = {"resnet-basic": lambda: _resnet("basic"), "resnet-bottleneck": lambda: _resnet("bottleneck"),
          "convnext": _convnext}  # fmt: skip


class Classifier(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixels, labels):
        return self.model(pixel_values=pixels, labels=labels).loss


@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_image_classifier_trains_like_eager(name):
    torch.manual_seed(0)
    model = Classifier(MODELS[name]()).double().train()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 4, (2,), generator=g))
               for _ in range(2)]  # fmt: skip
    assert_trains_like_eager(model, batches, "reference")
