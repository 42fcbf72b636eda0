"""Deterministic randomly initialised models, written as ordinary Hugging Face directories.

Random weights produce gibberish text but real state, real shapes and real timings, which is what
prompt-state reuse needs. Everything here is seeded, so two machines build byte-identical models.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast

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
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int


SIZES: dict[str, Size] = {
    # Llama-shaped, about 58 M parameters: the reference model of the reuse benchmarks.
    "default": Size(hidden=512, layers=8, heads=8, kv_heads=8, intermediate=1376, context=8192),
    # For tests: the same tokenizer, a few milliseconds per forward.
    "small": Size(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, context=4096),
}


def _dense_config(size: Size) -> PretrainedConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=size.context,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
    )


ARCHITECTURES: dict[str, Callable[[Size], PretrainedConfig]] = {
    "dense": _dense_config,
}


def _training_corpus(seed: int, n_words: int = 400_000) -> list[str]:
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


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a seeded corpus: any text encodes, training is deterministic."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(SEED), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=max(size.context for size in SIZES.values()),
    )


def init_model(arch: str, out_dir: Path, size: str = "default") -> Path:
    """Write a seeded random causal LM and its tokenizer to out_dir (created; must not exist)."""
    if arch not in ARCHITECTURES:
        raise UnknownArchitectureError(
            f"unknown architecture {arch!r}; choose one of: {', '.join(sorted(ARCHITECTURES))}")
    if size not in SIZES:
        raise UnknownArchitectureError(f"unknown size {size!r}; choose one of: {', '.join(sorted(SIZES))}")
    config = ARCHITECTURES[arch](SIZES[size])
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
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
