"""Deterministic randomly initialised models, written as ordinary Hugging Face directories.

Random weights produce gibberish text but real state, real shapes and real timings, which is what
prompt-state reuse needs. Everything here is seeded, so two machines build byte-identical models.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    BambaConfig,
    FalconH1Config,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteMoeHybridConfig,
    JambaConfig,
    Lfm2Config,
    LlamaConfig,
    Mamba2Config,
    MambaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen3NextConfig,
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 32000
SEED = 0
# Bump when the recipe changes so cached default models are rebuilt.
RECIPE_VERSION = 1

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class UnknownArchitectureError(ValueError):
    """Raised for an architecture name that has no recipe."""


@dataclass(frozen=True, slots=True)
class Size:
    """Shapes shared by every family; each recipe takes the fields its architecture has."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int
    mixed_layers: int
    """Layer count of the families that mix layer kinds: enough that every kind appears and one repeats."""
    attention_period: int
    """In mixed families every `attention_period`-th layer is (full) attention, the others are not."""
    window: int
    """Tokens a sliding-window layer attends to."""
    experts: int
    experts_per_token: int
    expert_intermediate: int
    shared_intermediate: int
    """The shared expert (Qwen MoE) or shared MLP (Granite) next to the routed experts."""
    ssm_heads: int
    """Mamba2 heads, and Qwen3-Next value heads; their head dim is `2 * hidden / ssm_heads`."""
    ssm_state: int
    ssm_chunk: int
    """Chunk length of the Mamba2 scan; small enough in tests that a prompt spans several chunks."""
    init_range: float | None = None
    """Weight init scale instead of the family's default (0.02). Tests need recurrent and conv layers whose
    state shows in the logits: at 0.02 a tiny model's Jamba, FalconH1 or Lfm2 state moved them by 2e-5 to
    9e-5 when zeroed, below the 1e-4 tolerance of the reuse checks; at 0.1, by 3e-2 to 3e-1."""


SIZES: dict[str, Size] = {
    # Llama-shaped dense, about 58 M parameters: the reference model of the reuse benchmarks. The
    # granite-moe-hybrid model of this size (6 Mamba2 + 2 attention layers, about 64 M) is the
    # hybrid benchmark's model.
    "default": Size(hidden=512, layers=8, heads=8, kv_heads=8, intermediate=1376, context=8192,
                    mixed_layers=8, attention_period=4, window=1024, experts=4, experts_per_token=2,
                    expert_intermediate=256, shared_intermediate=512, ssm_heads=16, ssm_state=64, ssm_chunk=256),
    # For tests: the same tokenizer, a few milliseconds per forward; windows and scan chunks shorter
    # than a test prompt.
    "small": Size(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, context=4096,
                  mixed_layers=4, attention_period=3, window=16, experts=4, experts_per_token=2,
                  expert_intermediate=32, shared_intermediate=64, ssm_heads=8, ssm_state=16, ssm_chunk=16,
                  init_range=0.1),
    # For GPU benchmarks: a Llama shape of about 1.10 B parameters, where the chip rather than Python
    # limits a step. Its hybrid is bamba (12 Mamba2 + 4 attention layers, about 1.29 B): the attention and
    # MLP blocks are the Llama's and every parameter is read for every token as in the dense model, so the
    # two differ only in the mixer (granite-moe-hybrid and the MoE families route tokens to some experts
    # only). Eight experts as wide together as the dense MLP keep the MoE families at the dense total.
    "1b": Size(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, context=32768,
               mixed_layers=16, attention_period=4, window=4096, experts=8, experts_per_token=2,
               expert_intermediate=1024, shared_intermediate=2048, ssm_heads=64, ssm_state=128, ssm_chunk=256),
}


def _vocabulary(size: Size) -> dict[str, Any]:
    """What every recipe shares: the tokenizer's ids and the context length."""
    return {
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": None,
        "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),
        "pad_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "max_position_embeddings": size.context,
    }


def _attention(size: Size) -> dict[str, Any]:
    return {"hidden_size": size.hidden, "num_attention_heads": size.heads, "num_key_value_heads": size.kv_heads}


def _every(size: Size, kind: str, otherwise: str) -> list[str]:
    """`config.layer_types` of a mixed family: `kind` at every `attention_period`-th layer."""
    return [kind if (i + 1) % size.attention_period == 0 else otherwise for i in range(size.mixed_layers)]


def _llama(size: Size) -> PretrainedConfig:
    """Heads of at least 32 dims, so that the small test model runs on the CPU kernels' decoder too."""
    return LlamaConfig(**_vocabulary(size), **_attention(size), head_dim=max(32, size.hidden // size.heads),
                       num_hidden_layers=size.layers, intermediate_size=size.intermediate, tie_word_embeddings=False)


def _mistral(size: Size) -> PretrainedConfig:
    return MistralConfig(**_vocabulary(size), **_attention(size), num_hidden_layers=size.layers,
                         intermediate_size=size.intermediate, sliding_window=size.window)


def _gemma2(size: Size) -> PretrainedConfig:
    """Sliding and full attention layers in turn (the config's own pattern)."""
    head_dim = size.hidden // size.heads
    return Gemma2Config(**_vocabulary(size), **_attention(size), num_hidden_layers=size.mixed_layers,
                        intermediate_size=size.intermediate, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                        sliding_window=size.window)


def _gemma3(size: Size) -> PretrainedConfig:
    """Runs of sliding layers between full ones, as in Gemma 3 (5:1 there)."""
    head_dim = size.hidden // size.heads
    return Gemma3TextConfig(**_vocabulary(size), **_attention(size), num_hidden_layers=size.mixed_layers,
                            intermediate_size=size.intermediate, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                            sliding_window=size.window,
                            layer_types=_every(size, "full_attention", "sliding_attention"))


def _mixtral(size: Size) -> PretrainedConfig:
    return MixtralConfig(**_vocabulary(size), **_attention(size), num_hidden_layers=size.layers,
                         intermediate_size=size.expert_intermediate, num_local_experts=size.experts,
                         num_experts_per_tok=size.experts_per_token)


def _olmoe(size: Size) -> PretrainedConfig:
    return OlmoeConfig(**_vocabulary(size), **_attention(size), num_hidden_layers=size.layers,
                       intermediate_size=size.expert_intermediate, num_experts=size.experts,
                       num_experts_per_tok=size.experts_per_token)


def _qwen2_moe(size: Size) -> PretrainedConfig:
    return Qwen2MoeConfig(**_vocabulary(size), **_attention(size), num_hidden_layers=size.layers,
                          intermediate_size=size.intermediate, moe_intermediate_size=size.expert_intermediate,
                          shared_expert_intermediate_size=size.shared_intermediate, num_experts=size.experts,
                          num_experts_per_tok=size.experts_per_token)


def _mamba(size: Size) -> PretrainedConfig:
    """Mamba has no positions; `max_position_embeddings` is stored as an extra attribute for the loader."""
    return MambaConfig(**_vocabulary(size), hidden_size=size.hidden, num_hidden_layers=size.layers,
                       state_size=size.ssm_state)


def _mamba2(size: Size) -> PretrainedConfig:
    """Like Mamba, an extra `max_position_embeddings` attribute."""
    return Mamba2Config(**_vocabulary(size), hidden_size=size.hidden, num_hidden_layers=size.layers,
                        num_heads=size.ssm_heads, head_dim=2 * size.hidden // size.ssm_heads, n_groups=1,
                        state_size=size.ssm_state, chunk_size=size.ssm_chunk)


def _mamba2_mixer(size: Size) -> dict[str, Any]:
    """The Mamba2 mixer of the Bamba, Falcon-H1 and Granite hybrids."""
    return {"mamba_n_heads": size.ssm_heads, "mamba_n_groups": 1, "mamba_d_state": size.ssm_state,
            "mamba_chunk_size": size.ssm_chunk}


def _jamba(size: Size) -> PretrainedConfig:
    """Mamba (v1) layers with one attention layer per period; experts in every other layer."""
    return JambaConfig(**_vocabulary(size), **_attention(size), num_hidden_layers=size.mixed_layers,
                       attn_layer_period=size.attention_period, attn_layer_offset=size.attention_period - 1,
                       intermediate_size=size.expert_intermediate, num_experts=size.experts,
                       num_experts_per_tok=size.experts_per_token, mamba_d_state=size.ssm_state)


def _bamba(size: Size) -> PretrainedConfig:
    pattern = _every(size, "full_attention", "linear_attention")
    return BambaConfig(**_vocabulary(size), **_attention(size), num_hidden_layers=size.mixed_layers,
                       intermediate_size=size.intermediate, **_mamba2_mixer(size),
                       attn_layer_indices=[i for i, kind in enumerate(pattern) if kind == "full_attention"])


def _falcon_h1(size: Size) -> PretrainedConfig:
    """Attention and Mamba2 side by side in every layer."""
    return FalconH1Config(**_vocabulary(size), **_attention(size), num_hidden_layers=size.layers,
                          intermediate_size=size.intermediate, mamba_d_ssm=2 * size.hidden, **_mamba2_mixer(size))


def _granite_moe_hybrid(size: Size) -> PretrainedConfig:
    """Granite 4.0-H shape: Mamba2 and attention layers without positional embeddings, experts plus a shared MLP."""
    return GraniteMoeHybridConfig(**_vocabulary(size), **_attention(size), num_hidden_layers=size.mixed_layers,
                                  layer_types=_every(size, "full_attention", "linear_attention"),
                                  intermediate_size=size.expert_intermediate, num_local_experts=size.experts,
                                  num_experts_per_tok=size.experts_per_token,
                                  shared_intermediate_size=size.shared_intermediate, **_mamba2_mixer(size))


def _lfm2(size: Size) -> PretrainedConfig:
    """Short gated convolutions with attention layers between them."""
    return Lfm2Config(**_vocabulary(size), **_attention(size), num_hidden_layers=size.mixed_layers,
                      layer_types=_every(size, "full_attention", "conv"), intermediate_size=size.intermediate,
                      block_auto_adjust_ff_dim=False)


def _qwen3_next(size: Size) -> PretrainedConfig:
    """Gated delta-net layers with gated attention layers between them; experts plus a shared expert."""
    linear_head_dim = 2 * size.hidden // size.ssm_heads
    return Qwen3NextConfig(**_vocabulary(size), **_attention(size), num_hidden_layers=size.mixed_layers,
                           layer_types=_every(size, "full_attention", "linear_attention"),
                           head_dim=size.hidden // size.heads, intermediate_size=size.intermediate,
                           linear_num_key_heads=size.ssm_heads // 2, linear_num_value_heads=size.ssm_heads,
                           linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim,
                           moe_intermediate_size=size.expert_intermediate,
                           shared_expert_intermediate_size=size.shared_intermediate, num_experts=size.experts,
                           num_experts_per_tok=size.experts_per_token)


FAMILIES: dict[str, Callable[[Size], PretrainedConfig]] = {
    "llama": _llama,
    "mistral": _mistral,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "qwen2-moe": _qwen2_moe,
    "mamba": _mamba,
    "mamba2": _mamba2,
    "jamba": _jamba,
    "bamba": _bamba,
    "falcon-h1": _falcon_h1,
    "granite-moe-hybrid": _granite_moe_hybrid,
    "lfm2": _lfm2,
    "qwen3-next": _qwen3_next,
}

# The architecture classes the node must serve, each named by the family that stands for it.
CLASSES: dict[str, str] = {
    "dense": "llama",
    "swa": "mistral",
    "alternating": "gemma2",
    "ssm": "mamba2",
    "hybrid": "bamba",
    "moe": "mixtral",
    "hybrid-moe": "qwen3-next",
}

ARCHITECTURES: dict[str, Callable[[Size], PretrainedConfig]] = {
    **FAMILIES, **{name: FAMILIES[family] for name, family in CLASSES.items()}}


def training_corpus(seed: int, n_words: int = 400_000) -> list[str]:
    """Pseudo-English lines from a seeded syllable lexicon with a Zipf-like word distribution."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "z", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "ie", "oo", "ou"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "ng", "st", "nd", "ck"]
    lexicon = [
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                for _ in range(rng.choice([1, 1, 2, 2, 3, 4])))
        for _ in range(40_000)
    ]
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    words = rng.choices(lexicon, weights=weights, k=n_words)
    lines = []
    for start in range(0, n_words, 12):
        sentence = " ".join(words[start:start + 12]).capitalize()
        lines.append(sentence + rng.choice(".,?!:;") + rng.choice(["", " 42", " (x)", ' "q"', "\n"]))
    return lines


@functools.cache
def _trained_tokenizer() -> str:
    """The trained tokenizer as JSON, trained once per process: training takes seconds, the result never changes."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(SEED), trainer)
    return tokenizer.to_str()


def build_tokenizer(context: int = SIZES["default"].context, named_tokens: dict[str, str] | None = None,
                    chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a seeded corpus: any text encodes, training is deterministic.

    `context` is the model's context length: the tokenizer warns about longer inputs, so a 32k model's
    tokenizer must not claim a shorter limit. `named_tokens` (attribute -> token, such as a vision model's
    `image_token`) are special tokens added after the trained vocabulary in their order, so the trained ids
    stay those of the text models."""
    # Passed only when there are some: `extra_special_tokens=None` still writes an entry to
    # tokenizer_config.json, which would change the text models' files.
    named = {"extra_special_tokens": named_tokens} if named_tokens else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer()),
        chat_template=chat_template,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=context,
        **named,
    )


def init_model(arch: str, out_dir: Path, size: str = "default") -> Path:
    """Write a seeded random causal LM and its tokenizer to out_dir (created; must not exist).

    A vision- or audio-language architecture (`synthetic_vlm.VISION_LANGUAGE`, `synthetic_alm.AUDIO_LANGUAGE`) is
    written with its processor instead."""
    # Imported here: synthetic_vlm and synthetic_alm build on this module's recipes and tokenizer.
    from node.engine.synthetic_alm import AUDIO_LANGUAGE, init_audio_language_model
    from node.engine.synthetic_vlm import VISION_LANGUAGE, init_vision_language_model

    if arch in VISION_LANGUAGE:
        return init_vision_language_model(arch, Path(out_dir), size)
    if arch in AUDIO_LANGUAGE:
        return init_audio_language_model(arch, Path(out_dir), size)
    if arch == "diffusion":  # an image pipeline, one size (node.media.synthetic_diffusion)
        from node.media.synthetic_diffusion import init_diffusion_model

        return init_diffusion_model(Path(out_dir))
    if arch not in ARCHITECTURES:
        raise UnknownArchitectureError(
            f"unknown architecture {arch!r}; choose one of: "
            f"{', '.join(sorted([*ARCHITECTURES, *VISION_LANGUAGE, *AUDIO_LANGUAGE]))}")
    if size not in SIZES:
        raise UnknownArchitectureError(f"unknown size {size!r}; choose one of: {', '.join(sorted(SIZES))}")
    config = ARCHITECTURES[arch](SIZES[size])
    if SIZES[size].init_range is not None:
        config.initializer_range = SIZES[size].init_range
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    model.save_pretrained(out_dir)
    build_tokenizer(SIZES[size].context).save_pretrained(out_dir)
    return out_dir


def ensure_default_model(models_dir: Path, arch: str = "dense", size: str = "default") -> Path:
    """Build the embedded default model into models_dir on first use; later calls return it.

    Built in a temporary directory and renamed into place, so concurrent first starts cannot
    observe a half-written model.
    """
    target = Path(models_dir) / f"{arch}-{size}-v{RECIPE_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        init_model(arch, staging / "model", size)
        try:
            os.rename(staging / "model", target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
