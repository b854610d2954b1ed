"""The wider hunt: qcore against its peers on ~40 more transformers architectures.

    python benchmarks/realmodels_wide.py [--models a,b] [--cases fx:x86,pt2e:x86,...]
                                         [--timeout 180] [--out table.md]

tests/realmodels is the corpus CI runs (and benchmarks/realmodels.py its full
table); this script adds the architectures of stop 26's hunt (tiny configs, random
weights, nothing downloaded) to that corpus's registry at run time and runs each
(model, path, backend) through the same harness, one subprocess a case so a hang or
a crash costs one row. PT2E on qnnpack is compared with torchao's XNNPACK-style
test quantizer (per-tensor weights), the closest peer torchao 0.18 ships; its recipe
is not qnnpack's (weights on [-127, 127], fewer ops quantized), so 0.5-3.5 dB either
way there is the recipe, not a fault (FINDINGS.md 6). It prints
a markdown table with every case qcore fails where its peer runs, or scores more
than 0.5 dB below it, marked. A search, not a test: tests/realmodels/FINDINGS.md 6
says what it found. Needs transformers (the venv of benchmarks/realmodels.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers as T  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import realmodels.harness as harness  # noqa: E402
import realmodels.models as M  # noqa: E402

import qcore  # noqa: E402

V, H = M.VOCAB, 32  # the corpus's vocabulary and width


def _images_of(size):
    def data(seed, batches):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(M.BATCH, 3, size, size, generator=g),) for _ in range(batches)]

    return data


def _ast_mel(seed, batches):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(M.BATCH, 32, 16, generator=g),) for _ in range(batches)]


_enc = M.SMALL_BERT

_dec = dict(
    vocab_size=V,
    hidden_size=H,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=32,
    use_cache=False,
)

_w2v = M.SMALL_WAV2VEC2


def _model(model_class, config_class, model_kwargs=None, **config) -> Callable[[], nn.Module]:
    """A builder of ``model_class`` on a ``config_class(**config)``: random weights."""
    return lambda: model_class(config_class(**config), **(model_kwargs or {}))


MORE: dict[str, tuple[str, Callable[[], nn.Module], Callable]] = {
    "swin": (
        "vision",
        _model(
            T.SwinForImageClassification,
            T.SwinConfig,
            image_size=32,
            patch_size=2,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[1, 2],
            window_size=4,
            mlp_ratio=2.0,
            num_labels=10,
        ),
        M._images,
    ),
    "mobilevit": (
        "vision",
        _model(
            T.MobileViTForImageClassification,
            T.MobileViTConfig,
            image_size=64,
            patch_size=2,
            hidden_sizes=[16, 24, 32],
            neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
            num_attention_heads=2,
            mlp_ratio=2.0,
            expand_ratio=2.0,
            num_labels=10,
        ),
        _images_of(64),
    ),
    "deit": (
        "vision",
        _model(
            T.DeiTForImageClassification,
            T.DeiTConfig,
            **M.SMALL_VIT,
            num_labels=10,
        ),
        M._images,
    ),
    "dinov2": (
        "vision",
        _model(
            T.Dinov2Model,
            T.Dinov2Config,
            image_size=32,
            patch_size=8,
            hidden_size=H,
            num_hidden_layers=2,
            num_attention_heads=2,
            mlp_ratio=2,
        ),
        M._images,
    ),
    "segformer": (
        "vision",
        _model(
            T.SegformerForImageClassification,
            T.SegformerConfig,
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[7, 3],
            strides=[4, 2],
            num_attention_heads=[1, 2],
            mlp_ratios=[2, 2],
            decoder_hidden_size=32,
            num_labels=10,
        ),
        M._images,
    ),
    "poolformer": (
        "vision",
        _model(
            T.PoolFormerForImageClassification,
            T.PoolFormerConfig,
            num_encoder_blocks=2,
            depths=[1, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[7, 3],
            strides=[4, 2],
            padding=[2, 1],
            mlp_ratio=2.0,
            num_labels=10,
        ),
        M._images,
    ),
    "levit": (
        "vision",
        _model(
            T.LevitForImageClassification,
            T.LevitConfig,
            image_size=32,
            hidden_sizes=[32, 64],
            num_attention_heads=[2, 2],
            depths=[1, 1],
            key_dim=[8, 8],
            mlp_ratio=[2, 2],
            attention_ratio=[2, 2],
            down_ops=[["Subsample", 8, 32 // 8, 4, 2, 2], [""]],
            num_labels=10,
        ),
        M._images,
    ),
    "mobilenet_v1": (
        "vision",
        _model(
            T.MobileNetV1ForImageClassification,
            T.MobileNetV1Config,
            image_size=32,
            depth_multiplier=0.25,
            tf_padding=False,
            num_labels=10,
        ),
        M._images,
    ),
    "convnextv2": (
        "vision",
        _model(
            T.ConvNextV2ForImageClassification,
            T.ConvNextV2Config,
            hidden_sizes=[16, 32],
            depths=[1, 1],
            num_stages=2,
            num_labels=10,
        ),
        M._images,
    ),
    "resnet_bottleneck": (
        "vision",
        _model(
            T.ResNetForImageClassification,
            T.ResNetConfig,
            embedding_size=16,
            hidden_sizes=[32, 64],
            depths=[1, 1],
            layer_type="bottleneck",
            num_labels=10,
        ),
        M._images,
    ),
    "roberta": (
        "text",
        _model(
            T.RobertaModel,
            T.RobertaConfig,
            model_kwargs=dict(add_pooling_layer=False),
            **_enc,
            pad_token_id=1,
        ),
        M._tokens,
    ),
    "albert": (
        "text",
        _model(
            T.AlbertModel,
            T.AlbertConfig,
            model_kwargs=dict(add_pooling_layer=False),
            **_enc,
            embedding_size=16,
        ),
        M._tokens,
    ),
    "electra": (
        "text",
        _model(T.ElectraModel, T.ElectraConfig, **_enc, embedding_size=16),
        M._tokens,
    ),
    "squeezebert": (
        "text",
        _model(
            T.SqueezeBertModel,
            T.SqueezeBertConfig,
            **_enc,
            embedding_size=H,
            q_groups=2,
            k_groups=2,
            v_groups=2,
            post_attention_groups=2,
            intermediate_groups=2,
            output_groups=2,
        ),
        M._tokens,
    ),
    "deberta_v2": (
        "text",
        _model(
            T.DebertaV2Model,
            T.DebertaV2Config,
            **_enc,
            relative_attention=True,
            position_buckets=8,
            pos_att_type=["p2c", "c2p"],
            max_relative_positions=-1,
        ),
        M._tokens,
    ),
    "mpnet": (
        "text",
        _model(T.MPNetModel, T.MPNetConfig, model_kwargs=dict(add_pooling_layer=False), **_enc),
        M._tokens,
    ),
    "t5_encoder": (
        "text",
        _model(
            T.T5EncoderModel,
            T.T5Config,
            vocab_size=V,
            d_model=H,
            d_kv=16,
            d_ff=64,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            pad_token_id=0,
        ),
        M._tokens,
    ),
    "llama": (
        "text",
        _model(T.LlamaModel, T.LlamaConfig, **_dec, num_key_value_heads=1),
        M._tokens,
    ),
    "qwen2": (
        "text",
        _model(T.Qwen2Model, T.Qwen2Config, **_dec, num_key_value_heads=1),
        M._tokens,
    ),
    "opt": (
        "text",
        _model(
            T.OPTModel,
            T.OPTConfig,
            vocab_size=V,
            hidden_size=H,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=32,
            word_embed_proj_dim=H,
            use_cache=False,
            pad_token_id=1,
        ),
        M._tokens,
    ),
    "phi": ("text", _model(T.PhiModel, T.PhiConfig, **_dec, partial_rotary_factor=0.5), M._tokens),
    "hubert": ("audio", _model(T.HubertModel, T.HubertConfig, **_w2v), M._audio),
    "wavlm": (
        "audio",
        _model(T.WavLMModel, T.WavLMConfig, **_w2v, num_buckets=16, max_bucket_distance=32),
        M._audio,
    ),
    "ast": (
        "audio",
        _model(
            T.ASTForAudioClassification,
            T.ASTConfig,
            hidden_size=H,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            patch_size=8,
            frequency_stride=8,
            time_stride=8,
            max_length=32,
            num_mel_bins=16,
            num_labels=10,
        ),
        _ast_mel,
    ),
    "gemma": (
        "text",
        _model(T.GemmaModel, T.GemmaConfig, **_dec, num_key_value_heads=1, head_dim=16),
        M._tokens,
    ),
    "mistral": (
        "text",
        _model(T.MistralModel, T.MistralConfig, **_dec, num_key_value_heads=1, sliding_window=8),
        M._tokens,
    ),
    "bloom": (
        "text",
        _model(
            T.BloomModel,
            T.BloomConfig,
            vocab_size=V,
            hidden_size=H,
            n_layer=2,
            n_head=2,
            use_cache=False,
        ),
        M._tokens,
    ),
    "falcon": (
        "text",
        _model(
            T.FalconModel,
            T.FalconConfig,
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=2,
            num_attention_heads=2,
            use_cache=False,
            new_decoder_architecture=False,
            multi_query=True,
            parallel_attn=True,
            alibi=False,
        ),
        M._tokens,
    ),
    "gpt_neox": (
        "text",
        _model(
            T.GPTNeoXModel,
            T.GPTNeoXConfig,
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            rotary_pct=0.5,
            use_cache=False,
        ),
        M._tokens,
    ),
    "gpt_neo": (
        "text",
        _model(
            T.GPTNeoModel,
            T.GPTNeoConfig,
            vocab_size=V,
            hidden_size=H,
            num_layers=2,
            num_heads=2,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
            max_position_embeddings=32,
            use_cache=False,
        ),
        M._tokens,
    ),
    "codegen": (
        "text",
        _model(
            T.CodeGenModel,
            T.CodeGenConfig,
            vocab_size=V,
            n_embd=H,
            n_layer=2,
            n_head=2,
            rotary_dim=8,
            n_positions=32,
            use_cache=False,
        ),
        M._tokens,
    ),
    "gpt_bigcode": (
        "text",
        _model(
            T.GPTBigCodeModel,
            T.GPTBigCodeConfig,
            vocab_size=V,
            n_embd=H,
            n_layer=2,
            n_head=2,
            n_positions=32,
            multi_query=True,
            use_cache=False,
        ),
        M._tokens,
    ),
    "clip_vision": (
        "vision",
        _model(
            T.CLIPVisionModel,
            T.CLIPVisionConfig,
            **M.SMALL_VIT,
        ),
        M._images,
    ),
    "siglip_vision": (
        "vision",
        _model(
            T.SiglipVisionModel,
            T.SiglipVisionConfig,
            **M.SMALL_VIT,
        ),
        M._images,
    ),
    "focalnet": (
        "vision",
        _model(
            T.FocalNetForImageClassification,
            T.FocalNetConfig,
            image_size=32,
            patch_size=4,
            embed_dim=16,
            depths=[1, 1],
            focal_levels=[2, 2],
            focal_windows=[3, 3],
            num_labels=10,
        ),
        M._images,
    ),
    "pvt": (
        "vision",
        _model(
            T.PvtForImageClassification,
            T.PvtConfig,
            image_size=32,
            num_encoder_blocks=2,
            depths=[1, 1],
            sequence_reduction_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[4, 2],
            strides=[4, 2],
            num_attention_heads=[1, 2],
            mlp_ratios=[2, 2],
            num_labels=10,
        ),
        M._images,
    ),
    "swiftformer": (
        "vision",
        _model(
            T.SwiftFormerForImageClassification,
            T.SwiftFormerConfig,
            image_size=32,
            depths=[1, 1],
            embed_dims=[16, 32],
            downsamples=[True, True],
            num_labels=10,
        ),
        M._images,
    ),
    "data2vec_vision": (
        "vision",
        _model(
            T.Data2VecVisionForImageClassification,
            T.Data2VecVisionConfig,
            **M.SMALL_VIT,
            use_relative_position_bias=False,
            use_mean_pooling=True,
            num_labels=10,
        ),
        M._images,
    ),
    "convbert": (
        "text",
        _model(
            T.ConvBertModel,
            T.ConvBertConfig,
            **_enc,
            embedding_size=H,
            head_ratio=2,
            conv_kernel_size=3,
            num_groups=1,
        ),
        M._tokens,
    ),
    "funnel": (
        "text",
        _model(
            T.FunnelBaseModel,
            T.FunnelConfig,
            vocab_size=V,
            d_model=H,
            n_head=2,
            d_head=16,
            d_inner=64,
            block_sizes=[1, 1],
            block_repeats=[1, 1],
            num_decoder_layers=1,
            max_position_embeddings=32,
        ),
        M._tokens,
    ),
    "data2vec_audio": (
        "audio",
        _model(
            T.Data2VecAudioModel,
            T.Data2VecAudioConfig,
            **{
                k: v
                for k, v in _w2v.items()
                if k
                not in (
                    "do_stable_layer_norm",
                    "feat_extract_norm",
                    "num_conv_pos_embedding_groups",
                    "num_conv_pos_embeddings",
                )
            },
            num_conv_pos_embedding_groups=2,
            conv_pos_kernel_size=5,
            num_conv_pos_embeddings=5,
        ),
        M._audio,
    ),
    "sew": ("audio", _model(T.SEWModel, T.SEWConfig, **_w2v, squeeze_factor=2), M._audio),
    "unispeech": ("audio", _model(T.UniSpeechModel, T.UniSpeechConfig, **_w2v), M._audio),
}


def _mono_audio(seed, batches):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(M.BATCH, 1, 800, generator=g) * 0.3,) for _ in range(batches)]


def _fbank(seed, batches):
    """Speech2Text's input: (batch, frames, 24 filter banks)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(M.BATCH, 16, 24, generator=g),) for _ in range(batches)]


class EncodecCodec(nn.Module):
    """EnCodec's encoder then decoder (its codebooks are not a float function)."""

    def __init__(self, model):
        super().__init__()
        self.encoder, self.decoder = model.encoder, model.decoder

    def forward(self, audio):
        return (self.decoder(self.encoder(audio)),)


def _speech2text_encoder():
    config = T.Speech2TextConfig(
        vocab_size=V, d_model=H, encoder_layers=2, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, input_feat_per_channel=24, conv_channels=32,
        max_source_positions=64,
    )  # fmt: skip
    return T.Speech2TextModel(config).encoder


#: Stop 37's hunt (tests/realmodels/FINDINGS.md 9): LSTM and weight-normed conv1d
#: (EnCodec), conv projections in attention (CvT), relative attention (XLNet),
#: rotary parallel blocks (GPT-J), asymmetric kernels (TextNet), pooled windows
#: (Hiera), state written in forward (RWKV), selective scan (Mamba), a conv
#: subsampler with GLU (Speech2Text), windowed attention (ViTDet).
MORE.update(
    {
        "encodec": (
            "audio",
            lambda: EncodecCodec(
                T.EncodecModel(
                    T.EncodecConfig(
                        num_filters=8,
                        upsampling_ratios=[4, 2],
                        codebook_size=32,
                        hidden_size=16,
                        num_lstm_layers=1,
                        target_bandwidths=[1.5],
                        sampling_rate=8000,
                        audio_channels=1,
                    )
                )
            ),
            _mono_audio,
        ),
        "cvt": (
            "vision",
            # transformers' CvT indexes its drop-path rates past the end below 13 blocks
            _model(
                T.CvtForImageClassification,
                T.CvtConfig,
                embed_dim=[16, 24, 32],
                num_heads=[1, 1, 2],
                depth=[1, 2, 10],
                num_labels=10,
            ),
            M._images,
        ),
        "xlnet": (
            "text",
            _model(
                T.XLNetModel,
                T.XLNetConfig,
                vocab_size=V,
                d_model=H,
                n_layer=2,
                n_head=2,
                d_inner=64,
                use_mems_eval=False,
            ),
            M._tokens,
        ),
        "gptj": (
            "text",
            _model(
                T.GPTJModel,
                T.GPTJConfig,
                vocab_size=V,
                n_embd=H,
                n_layer=2,
                n_head=2,
                rotary_dim=8,
                n_positions=32,
                use_cache=False,
            ),
            M._tokens,
        ),
        "textnet": ("vision", _model(T.TextNetModel, T.TextNetConfig), M._images),
        "hiera": (
            "vision",
            _model(
                T.HieraForImageClassification,
                T.HieraConfig,
                embed_dim=16,
                image_size=[32, 32],
                patch_size=[3, 3],
                patch_stride=[2, 2],
                patch_padding=[1, 1],
                depths=[1, 1],
                num_heads=[1, 2],
                query_stride=[2, 2],
                masked_unit_size=[4, 4],
                num_query_pool=1,
                num_labels=10,
            ),
            M._images,
        ),
        "rwkv": (
            "text",
            _model(
                T.RwkvModel,
                T.RwkvConfig,
                vocab_size=V,
                context_length=32,
                hidden_size=H,
                num_hidden_layers=2,
                attention_hidden_size=H,
                intermediate_size=64,
                use_cache=False,
            ),
            M._tokens,
        ),
        "mamba": (
            "text",
            _model(
                T.MambaModel,
                T.MambaConfig,
                vocab_size=V,
                hidden_size=H,
                state_size=8,
                num_hidden_layers=2,
                expand=2,
                conv_kernel=4,
                use_cache=False,
            ),
            M._tokens,
        ),
        "speech2text_encoder": ("audio", _speech2text_encoder, _fbank),
        "vitdet": (
            "vision",
            _model(
                T.VitDetModel,
                T.VitDetConfig,
                hidden_size=H,
                num_hidden_layers=2,
                num_attention_heads=2,
                mlp_ratio=2,
                image_size=32,
                pretrain_image_size=32,
                patch_size=8,
                out_features=["stage2"],
            ),
            M._images,
        ),
    }
)


class DeiTBody(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.deit, self.classifier = model.model.deit, model.model.classifier

    def forward(self, pixel_values):
        h = self.deit.embeddings(pixel_values)
        for layer in self.deit.layers:
            h = layer(h, None)
        return self.classifier(self.deit.layernorm(h)[:, 0, :])


def _rope(model):
    ids = torch.arange(M.TOKENS).unsqueeze(0)
    with torch.no_grad():
        return model.rotary_emb(torch.zeros(1, M.TOKENS, 1), ids)


class LlamaLikeBody(nn.Module):
    """Llama/Qwen2: embeddings, pre-norm blocks (a None mask: causal in sdpa), norm."""

    def __init__(self, model):
        super().__init__()
        self.m = model.model
        cos, sin = _rope(self.m)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, input_ids):
        h = self.m.embed_tokens(input_ids)
        for layer in self.m.layers:
            r = h
            a = layer.self_attn(
                layer.input_layernorm(h),
                position_embeddings=(self.cos, self.sin),
                attention_mask=None,
            )[0]
            h = r + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.m.norm(h)


class PhiBody(LlamaLikeBody):
    def forward(self, input_ids):
        h = self.m.embed_tokens(input_ids)
        for layer in self.m.layers:
            x = layer.input_layernorm(h)
            a = layer.self_attn(x, position_embeddings=(self.cos, self.sin), attention_mask=None)[0]
            h = a + layer.mlp(x) + h
        return self.m.final_layernorm(h)


class OPTBody(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.d = model.model.decoder
        self.register_buffer("positions", torch.arange(M.TOKENS).unsqueeze(0) + 2, persistent=False)

    def forward(self, input_ids):
        d = self.d
        h = d.embed_tokens(input_ids) + nn.Embedding.forward(d.embed_positions, self.positions)
        for layer in d.layers:
            h = h + layer.self_attn(layer.self_attn_layer_norm(h), attention_mask=None)[0]
            h = h + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(h))))
        return d.final_layer_norm(h)


def _capture_kwargs(module, root, inputs):
    """The (args, kwargs) ``module`` is called with when ``root`` runs on ``inputs``."""
    seen = {}

    def hook(mod, args, kwargs):
        seen["a"], seen["k"] = args, kwargs

    h = module.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        root(*inputs)
    h.remove()
    return seen["a"], seen["k"]


class SqueezeBertBody(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model.model
        ids = M._tokens(M.CALIBRATION_SEED, 1)[0]
        a, k = _capture_kwargs(self.m.encoder, model, ids)
        mask = k.get("attention_mask", a[1] if len(a) > 1 else None)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, input_ids):
        h = self.m.embeddings(input_ids).permute(0, 2, 1)
        for layer in self.m.encoder.layers:
            h = layer(h, self.mask, False)["feature_map"]
        return h.permute(0, 2, 1)


class DebertaV2Body(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model.model
        ids = M._tokens(M.CALIBRATION_SEED, 1)[0]
        a, k = _capture_kwargs(self.m.encoder, model, ids)
        enc = self.m.encoder
        hidden = k.get("hidden_states", a[0] if a else None)
        mask = k.get("attention_mask", a[1] if len(a) > 1 else None)
        with torch.no_grad():
            self.register_buffer("mask", enc.get_attention_mask(mask), persistent=False)
            self.register_buffer("rel", enc.get_rel_pos(hidden, None, None), persistent=False)
        assert enc.conv is None

    def forward(self, input_ids):
        enc = self.m.encoder
        h = self.m.embeddings(input_ids)
        rel_embeddings = enc.get_rel_embedding()
        for layer in enc.layer:
            a = layer.attention(
                h,
                self.mask,
                query_states=None,
                relative_pos=self.rel,
                rel_embeddings=rel_embeddings,
            )[0]
            h = layer.output(layer.intermediate(a), a)
        return h


BODIES = {
    "deit": DeiTBody,
    "llama": LlamaLikeBody,
    "qwen2": LlamaLikeBody,
    "phi": PhiBody,
    "opt": OPTBody,
    "squeezebert": SqueezeBertBody,
    "deberta_v2": DebertaV2Body,
}
#: The decoders have FX bodies only where written above: the rest run on PT2E.
DECODERS = ("gemma", "mistral", "bloom", "falcon", "gpt_neox", "gpt_neo", "codegen")
DECODERS += ("gpt_bigcode", "gptj")
DEFAULT_CASES = ("fx:x86", "fx:qnnpack", "fx:fbgemm", "pt2e:x86", "pt2e:qnnpack")


def register() -> None:
    """Add these architectures (and their FX bodies) to the corpus's registry."""
    M.BUILDERS.update(MORE)
    M.FX_BODIES.update(BODIES)
    M.MODELS = tuple(M.BUILDERS)


def _pt2e_side(case: M.Case, side: str, quantize) -> harness.SideResult:
    result, stage = harness.SideResult(side), "export"
    try:
        exported = harness._export(case)
        stage = "prepare"
        prepared = quantize(exported)
        stage = "calibrate"
        with torch.no_grad():
            for batch in case.calibration:
                prepared(*batch)
        stage = "convert"
        converted = qcore.convert_pt2e(prepared) if side == "qcore" else quantize.convert(prepared)
        stage = "run"
        result.sqnr = harness._score(case.model, converted, case.evaluation)
        result.weighted_quantized = harness._pt2e_weighted(converted)
    except Exception as error:  # noqa: BLE001 - a row says where each side failed
        return harness._fail(result, stage, error)
    result.ok = True
    return result


def _xnnpack_like(exported):
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e
    from torchao.testing.pt2e import _xnnpack_quantizer as xq

    quantizer = xq.XNNPACKQuantizer().set_global(
        xq.get_symmetric_quantization_config(is_per_channel=False)
    )
    return prepare_pt2e(exported, quantizer)


def _torchao_convert(prepared):
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    return convert_pt2e(prepared)


_xnnpack_like.convert = _torchao_convert


def one_case(name: str, path: str, backend: str) -> dict:
    """One case's row: each side's SQNR or where it failed."""
    register()
    if path == "pt2e" and backend != "x86":
        case = M.build(name)
        ours = _pt2e_side(case, "qcore", lambda exported: qcore.prepare_pt2e(exported, backend))
        theirs = _pt2e_side(case, "torchao (XNNPACK-style)", _xnnpack_like)
    else:
        result = harness.run_case(name, path, backend)
        ours, theirs = result.qcore, result.peer
    return {
        "qcore": ours.summary(),
        "peer": theirs.summary(),
        "ours": ours.sqnr,
        "theirs": theirs.sqnr,
        "ours_ok": ours.ok,
        "theirs_ok": theirs.ok,
    }


def _finding(row: dict) -> str:
    if row.get("timeout"):
        return "timeout"
    if row["theirs_ok"] and not row["ours_ok"]:
        return "**qcore fails**"
    if (
        row["ours_ok"]
        and row["theirs_ok"]
        and row["ours"] < row["theirs"] - harness.SQNR_TOLERANCE_DB
    ):
        return "**qcore below**"
    return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MORE))
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # model:path:backend, in a subprocess
    args = parser.parse_args(argv)
    if args.one:
        warnings.simplefilter("ignore")
        print(json.dumps(one_case(*args.one.split(":"))))
        return
    lines = ["| model | path | backend | qcore | peer | finding |", "|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        for path, backend in (case.split(":") for case in args.cases.split(",")):
            if path == "fx" and name in DECODERS:
                continue
            try:
                done = subprocess.run(
                    [sys.executable, __file__, "--one", f"{name}:{path}:{backend}"],
                    capture_output=True, text=True, timeout=args.timeout,
                )  # fmt: skip
                row = json.loads(done.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                row = {"timeout": True, "qcore": "-", "peer": "-"}
            except (json.JSONDecodeError, IndexError):
                row = {"qcore": f"crashed: {done.stderr.strip()[-200:]}", "peer": "-",
                       "ours_ok": False, "theirs_ok": False}  # fmt: skip
            cells = (name, path, backend, row["qcore"], row["peer"], _finding(row))
            line = "| " + " | ".join(cells) + " |"
            print(line, flush=True)
            lines.append(line)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
