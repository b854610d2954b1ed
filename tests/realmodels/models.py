"""Tiny real architectures from ``transformers``, built from configs with random weights.

    from realmodels.models import MODELS, build
    case = build("bert")     # case.model, case.example_inputs, case.calibration, case.evaluation

Nothing is downloaded: every model is ``XxxModel(XxxConfig(...))`` with tiny sizes
(hidden 16-64, two layers or stages, 32x32 images, 16 tokens, 0.1 s of audio), so
the whole corpus quantizes in seconds on two cores. Each model is wrapped in
:class:`MainOutput`, which returns the model's main tensor (logits or
last_hidden_state): the tensor SQNR is measured on, and a plain tensor output that
both torch.export and FX can hand back.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402

MODEL_SEED = 0
CALIBRATION_SEED = 1
EVAL_SEED = 2
BATCH_NORM_SEED = 3
BATCH = 2
CALIBRATION_BATCHES = 4
EVAL_BATCHES = 16
IMAGE = (3, 32, 32)
TOKENS = 16
VOCAB = 100
AUDIO_SAMPLES = 1600  # 0.1 s at 16 kHz
MEL_BINS, MEL_FRAMES = 16, 32


class MainOutput(nn.Module):
    """The model a user quantizes: the transformers model, returning its main tensor.

    transformers models return a ModelOutput (a dict subclass, sometimes with a cache);
    the first field is logits for the *ForImageClassification heads and
    last_hidden_state for the bare encoders.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)[0]


@dataclass
class Case:
    """One model of the corpus, ready to quantize and score."""

    name: str
    family: str  # vision, text, audio
    model: nn.Module  # MainOutput, in eval mode
    example_inputs: tuple[torch.Tensor, ...]
    calibration: list[tuple[torch.Tensor, ...]]
    evaluation: list[tuple[torch.Tensor, ...]]  # held out: other seed than calibration


def _images(seed: int, batches: int) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, *IMAGE, generator=generator),) for _ in range(batches)]


def _tokens(seed: int, batches: int) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (BATCH, TOKENS), generator=generator),) for _ in range(batches)
    ]


def _audio(seed: int, batches: int) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, AUDIO_SAMPLES, generator=generator),) for _ in range(batches)]


def _mel(seed: int, batches: int) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, MEL_BINS, MEL_FRAMES, generator=generator),) for _ in range(batches)
    ]


# ----------------------------------------------------------------------- the models

T = transformers


def resnet() -> nn.Module:
    """ResNet (basic blocks, two stages of one block)."""
    config = T.ResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="basic",
        num_labels=10,
    )
    return T.ResNetForImageClassification(config)


def mobilenet_v2() -> nn.Module:
    """MobileNetV2 at depth multiplier 0.25 (inverted residuals, relu6)."""
    config = T.MobileNetV2Config(
        image_size=IMAGE[1],
        depth_multiplier=0.25,
        finegrained_output=False,
        tf_padding=False,  # TF "same" padding computes pads with int() on shapes: untraceable
        num_labels=10,
    )
    return T.MobileNetV2ForImageClassification(config)


def efficientnet() -> nn.Module:
    """EfficientNet, three MBConv blocks (squeeze-excitation, swish)."""
    config = T.EfficientNetConfig(
        image_size=IMAGE[1],
        width_coefficient=0.25,
        depth_coefficient=1.0,
        in_channels=[32, 16, 24],
        out_channels=[16, 24, 40],
        kernel_sizes=[3, 3, 5],
        strides=[1, 2, 2],
        num_block_repeats=[1, 1, 1],
        expand_ratios=[1, 6, 6],
        hidden_dim=320,  # round_filters(config, 1280) at width 0.25
        num_labels=10,
    )
    return T.EfficientNetForImageClassification(config)


def convnext() -> nn.Module:
    """ConvNeXt, two stages (depthwise 7x7 conv, channels-last LayerNorm, GELU MLP)."""
    config = T.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=10)
    return T.ConvNextForImageClassification(config)


def regnet() -> nn.Module:
    """RegNet (Y-style blocks: grouped convs and squeeze-excitation), two stages."""
    config = T.RegNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        groups_width=8,
        layer_type="y",
        num_labels=10,
    )
    return T.RegNetForImageClassification(config)


#: ViT-style encoders' size: 8x8 patches of the corpus's images, hidden 32, two layers.
SMALL_VIT = dict(
    image_size=IMAGE[1],
    patch_size=8,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
)


def vit() -> nn.Module:
    """ViT, 8x8 patches, hidden 32, two layers."""
    return T.ViTForImageClassification(T.ViTConfig(**SMALL_VIT, num_labels=10))


def bit() -> nn.Module:
    """BiT: weight-standardized convs (a functional batch norm on each conv's weight)."""
    config = T.BitConfig(
        embedding_size=16, hidden_sizes=[16, 32], num_groups=8, depths=[1, 1], num_labels=10
    )
    return T.BitForImageClassification(config)


def beit() -> nn.Module:
    """BEiT with relative position bias (its index written in place in forward)."""
    config = T.BeitConfig(**SMALL_VIT, use_relative_position_bias=True, num_labels=10)
    return T.BeitForImageClassification(config)


def swinv2() -> nn.Module:
    """Swin V2: windowed attention, a position-bias MLP run on a buffer."""
    config = T.Swinv2Config(
        image_size=32,
        patch_size=2,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[1, 2],
        window_size=4,
        mlp_ratio=2.0,
        num_labels=10,
    )
    return T.Swinv2ForImageClassification(config)


#: BERT-style encoders' size: hidden 32, two layers of two heads, 32 positions.
SMALL_BERT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=32,
)


def bert() -> nn.Module:
    """BERT encoder, hidden 32, two layers."""
    config = T.BertConfig(**SMALL_BERT, add_pooling_layer=False)
    return T.BertModel(config, add_pooling_layer=False)


def mobilebert() -> nn.Module:
    """MobileBERT: bottlenecks, a (1, T, C) position embedding added to a linear output."""
    config = T.MobileBertConfig(
        **SMALL_BERT,
        embedding_size=16,
        intra_bottleneck_size=16,
        true_hidden_size=16,
        num_feedforward_networks=2,
    )
    return T.MobileBertModel(config, add_pooling_layer=False)


def distilbert() -> nn.Module:
    """DistilBERT encoder, dim 32, two layers."""
    config = T.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=32
    )
    return T.DistilBertModel(config)


def gpt2() -> nn.Module:
    """GPT-2 decoder (causal attention, Conv1D projections), no KV cache."""
    config = T.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=32,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
    )
    return T.GPT2Model(config)


def whisper_encoder() -> nn.Module:
    """Whisper's encoder (two strided conv1d over a log-mel input, then attention)."""
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = T.WhisperConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=MEL_BINS,
        max_source_positions=MEL_FRAMES // 2,
        pad_token_id=1,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return WhisperEncoder(config)


#: Wav2Vec2-style audio encoders' size: two conv feature layers (group norm), hidden 32.
SMALL_WAV2VEC2 = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    conv_dim=(16, 16),
    conv_stride=(5, 2),
    conv_kernel=(10, 3),
    num_feat_extract_layers=2,
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=2,
    do_stable_layer_norm=False,
    feat_extract_norm="group",
)


def wav2vec2() -> nn.Module:
    """Wav2Vec2 base layout: conv feature extractor (group norm), positional conv, attention."""
    return T.Wav2Vec2Model(T.Wav2Vec2Config(**SMALL_WAV2VEC2))


# ----------------------------------------------------------------------- FX bodies


class ViTBody(nn.Module):
    """ViTForImageClassification's computation without ViTModel.forward's dtype check and
    mask construction (control flow FX cannot trace): embeddings, layers, norm, head."""

    def __init__(self, model: MainOutput) -> None:
        super().__init__()
        self.vit = model.model.vit
        self.classifier = model.model.classifier

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.vit.embeddings(pixel_values)
        for layer in self.vit.layers:
            hidden = layer(hidden, None)
        return self.classifier(self.vit.layernorm(hidden)[:, 0, :])


class GPT2Body(nn.Module):
    """GPT2Model's computation without its cache and mask plumbing: token and position
    embeddings, blocks (causal attention from a None mask), final norm."""

    def __init__(self, model: MainOutput) -> None:
        super().__init__()
        self.gpt2 = model.model
        self.register_buffer("positions", torch.arange(TOKENS).unsqueeze(0), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.gpt2.wte(input_ids) + self.gpt2.wpe(self.positions)
        for block in self.gpt2.h:
            hidden = block(hidden, None, None)
        return self.gpt2.ln_f(hidden)


class WhisperEncoderBody(nn.Module):
    """WhisperEncoder's computation without its input-length check (control flow):
    two conv1d + GELU, positions, layers, final norm."""

    def __init__(self, model: MainOutput) -> None:
        super().__init__()
        self.encoder = model.model

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        encoder = self.encoder
        hidden = nn.functional.gelu(encoder.conv1(input_features))
        hidden = nn.functional.gelu(encoder.conv2(hidden)).permute(0, 2, 1)
        hidden = hidden + encoder.embed_positions.weight
        for layer in encoder.layers:
            hidden = layer(hidden, None)
        return encoder.layer_norm(hidden)


FX_BODIES: dict[str, Callable[[MainOutput], nn.Module]] = {
    "vit": ViTBody,
    "gpt2": GPT2Body,
    "whisper_encoder": WhisperEncoderBody,
}
"""The traceable part of models whose top-level forward FX cannot trace (qcore's
TraceFailure names the whole model): the same float function, checked in the tests."""


BUILDERS: dict[str, tuple[str, Callable[[], nn.Module], Callable]] = {
    "resnet": ("vision", resnet, _images),
    "mobilenet_v2": ("vision", mobilenet_v2, _images),
    "efficientnet": ("vision", efficientnet, _images),
    "convnext": ("vision", convnext, _images),
    "regnet": ("vision", regnet, _images),
    "vit": ("vision", vit, _images),
    "bit": ("vision", bit, _images),
    "beit": ("vision", beit, _images),
    "swinv2": ("vision", swinv2, _images),
    "bert": ("text", bert, _tokens),
    "mobilebert": ("text", mobilebert, _tokens),
    "distilbert": ("text", distilbert, _tokens),
    "gpt2": ("text", gpt2, _tokens),
    "whisper_encoder": ("audio", whisper_encoder, _mel),
    "wav2vec2": ("audio", wav2vec2, _audio),
}
MODELS = tuple(BUILDERS)


def _settle_batch_norm(model: nn.Module, data: list[tuple[torch.Tensor, ...]]) -> None:
    """Give batch norms the scales and running statistics training would: random init
    leaves them at mean 0, variance 1, and deep conv nets' activations then shrink to
    nothing (logits near 1e-18, which quantize to zero on every side). Cumulative
    averages over a few batches, with only the batch norms in train mode."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    for _ in range(2):  # a second pass sees the first pass's normalized activations
        for norm in norms:
            norm.reset_parameters()  # some inits (EfficientNet's) draw the scales near 0
            norm.momentum = None
            norm.train()
        with torch.no_grad():
            for batch in data:
                model(*batch)
    for norm in norms:
        norm.eval()


def build(name: str) -> Case:
    """A fresh Case for ``name``: same weights and data on every call (fixed seeds)."""
    try:
        family, make, data = BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; the corpus has {MODELS}") from None
    transformers.logging.set_verbosity_error()  # config sanity notes about unused heads
    torch.manual_seed(MODEL_SEED)
    model = MainOutput(make()).eval()
    _settle_batch_norm(model, data(BATCH_NORM_SEED, CALIBRATION_BATCHES))
    calibration = data(CALIBRATION_SEED, CALIBRATION_BATCHES)
    return Case(
        name=name,
        family=family,
        model=model,
        example_inputs=calibration[0],
        calibration=calibration,
        evaluation=data(EVAL_SEED, EVAL_BATCHES),
    )
