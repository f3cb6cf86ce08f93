"""Small random-initialised Hugging Face transformers models: the model zoo.

Each ``build_*`` returns :class:`precisiondiff.Workload` (forward and backward with a loss on the
logits) and works as a workload string, e.g. ``precisiondiff bisect tests/zoo/models.py:build_llama``.
The configs are tiny (hidden 32-64, 1-2 layers, sequences of 8-16) so that one capture takes about a
second on a CPU; weights are random (seeded by precisiondiff before the builder runs), nothing is
downloaded. Attention runs on the model's default path (sdpa where the class supports it), so the
stock kernels a user's model would hit are the ones exercised.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import precisiondiff

VOCAB = 96
SEQ = 12
BATCH = 2


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in float32 or wider, whatever the logits' dtype (as training code does); the labels
    follow the logits to their device (a loss closure's tensors are the workload's own: a GPU or MLU
    target moves the model and its inputs, not them)."""
    labels = labels.to(logits.device)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _lm_workload(model: torch.nn.Module) -> precisiondiff.Workload:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    return precisiondiff.Workload(model, {"input_ids": ids}, loss=lambda out: _ce(out.logits, labels))


def build_llama() -> precisiondiff.Workload:
    """A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return _lm_workload(LlamaForCausalLM(config))


def build_gpt2() -> precisiondiff.Workload:
    """GPT-2: LayerNorm, learned positions, GELU (tanh) MLP, Conv1D projections."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    return _lm_workload(GPT2LMHeadModel(config))


def build_bert() -> precisiondiff.Workload:
    """BERT with a sequence-classification head and an attention mask with padding."""
    from transformers import BertConfig, BertForSequenceClassification
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, num_labels=5)
    model = BertForSequenceClassification(config)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 3:] = 0
    labels = torch.randint(0, 5, (BATCH,))
    return precisiondiff.Workload(model, {"input_ids": ids, "attention_mask": mask},
                                  loss=lambda out: _ce(out.logits, labels))


def build_t5() -> precisiondiff.Workload:
    """T5 encoder-decoder: relative position bias, RMS-style LayerNorm, cross-attention."""
    from transformers import T5Config, T5ForConditionalGeneration
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                      num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(config)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    decoder_ids = torch.randint(1, VOCAB, (BATCH, SEQ // 2))
    labels = torch.randint(1, VOCAB, (BATCH, SEQ // 2))
    return precisiondiff.Workload(model, {"input_ids": ids, "decoder_input_ids": decoder_ids},
                                  loss=lambda out: _ce(out.logits, labels))


def build_vit() -> precisiondiff.Workload:
    """ViT: patch-embedding convolution, CLS token, pre-norm encoder, classification head."""
    from transformers import ViTConfig, ViTForImageClassification
    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=64, num_labels=10)
    model = ViTForImageClassification(config)
    pixels = torch.randn(BATCH, 3, 16, 16)
    labels = torch.randint(0, 10, (BATCH,))
    return precisiondiff.Workload(model, {"pixel_values": pixels}, loss=lambda out: _ce(out.logits, labels))


def build_mixtral() -> precisiondiff.Workload:
    """A Mixtral-style sparse mixture of experts: top-2 routing over 4 experts."""
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=64,
                           # the default grouped_mm experts have no float64 kernel (the reference
                           # target); the eager loop runs the same expert matmuls in every dtype
                           experts_implementation="eager")
    return _lm_workload(MixtralForCausalLM(config))


def build_resnet() -> precisiondiff.Workload:
    """transformers' ResNet: convolutions, BatchNorm, in-place ReLU, residual adds, pooling."""
    from transformers import ResNetConfig, ResNetForImageClassification
    config = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                          layer_type="basic", num_labels=10)
    model = ResNetForImageClassification(config)
    pixels = torch.randn(BATCH, 3, 32, 32)
    labels = torch.randint(0, 10, (BATCH,))
    return precisiondiff.Workload(model, {"pixel_values": pixels}, loss=lambda out: _ce(out.logits, labels))


def build_convnext() -> precisiondiff.Workload:
    """transformers' ConvNeXt: depthwise 7x7 convolutions, channels-last LayerNorm, GELU, layer scale."""
    from transformers import ConvNextConfig, ConvNextForImageClassification
    config = ConvNextConfig(num_channels=3, patch_size=4, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                            num_labels=10)
    model = ConvNextForImageClassification(config)
    pixels = torch.randn(BATCH, 3, 32, 32)
    labels = torch.randint(0, 10, (BATCH,))
    return precisiondiff.Workload(model, {"pixel_values": pixels}, loss=lambda out: _ce(out.logits, labels))
