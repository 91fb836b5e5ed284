"""Tiny causal language models and tokenizers built locally: no hub, deterministic.

``builtin:<name>`` anywhere a model path is accepted builds one of :data:`TINY_MODELS`
from the current torch seed. Tests, the CPU quickstart and the benchmarks use them; a real
run points the same config key at a hub id or a local checkpoint folder instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from gspo_lightning.errors import ConfigError

BUILTIN_PREFIX = "builtin:"
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# the lookup task's: an assistant turn is its bare content and the generation prompt is empty, so
# the model's turn starts right after what it answers (a tool's reply, the asked key)
LOOKUP_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ message['content'] }}\n"
    "{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture and tokenizer of a builtin model."""

    tokenizer: str = "words"  # "words": whitespace word-level over `words`; "bpe": BPE trained on `corpus`
    words: tuple[str, ...] = ()
    corpus: Optional[str] = None  # "gsm8k": the GSM8K subset shipped in gspo_lightning/data/datasets
    bpe_vocab_size: int = 2000
    # "llama", not "qwen2": transformers' AutoTokenizer forces Qwen2's byte-level tokenizer on
    # any qwen2 checkpoint, which drops the spaces of these tokenizers in exported folders
    model_type: str = "llama"  # or "qwen2_moe"
    vocab_size: Optional[int] = None  # pad the embedding to this size (None: the tokenizer's)
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    extra_config: dict = field(default_factory=dict)
    chat_template: str = CHAT_TEMPLATE


ECHO_WORDS = ("repeat", *[str(d) for d in range(10)])
SUCCESSOR_WORDS = ("next", *[str(d) for d in range(10)])
# the lookup task's episodes (data/tasks/lookup.py): chat roles as words, a tool, six keys, digits
LOOKUP_WORDS = ("user:", "assistant:", "tool:", "find", "get", "error", "a", "b", "c", "d", "e", "f", *[str(d) for d in range(10)])

TINY_MODELS: dict[str, TinyModelSpec] = {
    # a 2-layer model over a 14-token vocabulary (the echo task: tests, experiments)
    "tiny-echo": TinyModelSpec(words=ECHO_WORDS),
    # the quickstart: the same for the successor task
    "tiny-successor": TinyModelSpec(words=SUCCESSOR_WORDS),
    # the quickstart model with 2 heads of 32 dims (configs/quickstart_vllm.yaml): vLLM's CPU
    # attention has no kernel for heads of 16
    "tiny-successor-h32": TinyModelSpec(words=SUCCESSOR_WORDS, num_attention_heads=2, num_key_value_heads=1),
    # the judge of the successor task (data/tasks/successor_judge.py): its chat roles and "answer"
    # are words too; heads of 32 dims, so a stock vLLM server runs it on CPUs
    "tiny-successor-judge": TinyModelSpec(words=(*SUCCESSOR_WORDS, "answer", "user:", "assistant:"),
                                          num_attention_heads=2, num_key_value_heads=1),
    # multi-turn episodes with a tool (the lookup task); heads of 32 dims, so vLLM's CPU attention runs it too
    "tiny-lookup": TinyModelSpec(words=LOOKUP_WORDS, num_attention_heads=2, num_key_value_heads=1,
                                 chat_template=LOOKUP_CHAT_TEMPLATE),
    # the same with 8 small experts, for Mixture-of-Experts experiments
    "tiny-moe-echo": TinyModelSpec(
        words=ECHO_WORDS,
        model_type="qwen2_moe",
        extra_config=dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, decoder_sparse_step=1, output_router_logits=False,
        ),
    ),
    # a Qwen3-MoE: 4 layers of 16 experts, top-2, renormalized, no shared expert, so every token
    # is computed by the 2 experts its router picks: routing drift moves token log-probs
    # (experiments/paper_in_miniature.py, the Routing Replay claim)
    "tiny-moe16-echo": TinyModelSpec(
        words=ECHO_WORDS,
        model_type="qwen3_moe",
        num_hidden_layers=4,
        extra_config=dict(
            num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False, head_dim=16,
        ),
    ),
    # real text: BPE trained on the shipped GSM8K questions and answers
    "tiny-gsm8k": TinyModelSpec(tokenizer="bpe", corpus="gsm8k", bpe_vocab_size=2000, hidden_size=64),
    # a small model whose memory is dominated by a 32k vocabulary (benchmarks)
    "small-32k": TinyModelSpec(
        tokenizer="bpe", corpus="gsm8k", bpe_vocab_size=8000, vocab_size=32000,
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024,
    ),
}


def is_builtin(name_or_path: str) -> bool:
    return name_or_path.startswith(BUILTIN_PREFIX)


# the GSM8K subset shipped in the package (data/datasets/, there ``builtin:gsm8k`` and
# ``builtin:gsm8k-heldout``), read as files: a builtin model needs nothing outside the package,
# and models/ imports nothing from data/ (tests/test_folder_order.py checks both name the same files)
CORPUS_FILES: dict[str, tuple[Path, ...]] = {
    "gsm8k": tuple(Path(__file__).resolve().parents[1] / "data" / "datasets" / "gsm8k" / name
                   for name in ("train.jsonl", "heldout.jsonl")),
}


def _corpus_lines(corpus: str) -> Iterable[str]:
    if corpus not in CORPUS_FILES:
        raise ConfigError(f"unknown corpus {corpus!r}")
    for path in CORPUS_FILES[corpus]:
        with open(path) as handle:
            for line in handle:
                row = json.loads(line)
                yield row["question"]
                yield row["answer"]


def _wrap_tokenizer(tok, chat_template: str = CHAT_TEMPLATE):
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
    )
    wrapped.chat_template = chat_template
    wrapped.padding_side = "left"
    return wrapped


def build_tokenizer(spec: TinyModelSpec):
    """A ``PreTrainedTokenizerFast`` for the spec; spaces survive a round trip."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if spec.tokenizer == "words":
        vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *spec.words])}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        # WordLevel has no decoder of its own: the default joins tokens with single spaces
        return _wrap_tokenizer(tok, spec.chat_template)
    if spec.tokenizer == "bpe":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=spec.bpe_vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
        tok.train_from_iterator(_corpus_lines(spec.corpus or "gsm8k"), trainer=trainer)
        return _wrap_tokenizer(tok, spec.chat_template)
    raise ConfigError(f"unknown tokenizer kind {spec.tokenizer!r}")


def build_config(spec: TinyModelSpec, tokenizer):
    from transformers import AutoConfig

    vocab_size = max(len(tokenizer), spec.vocab_size or 0)
    return AutoConfig.for_model(
        spec.model_type,
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **spec.extra_config,
    )


def get_spec(name: str) -> TinyModelSpec:
    key = name[len(BUILTIN_PREFIX):] if is_builtin(name) else name
    if key not in TINY_MODELS:
        from gspo_lightning.models.gguf import GGUF_MODELS

        choices = sorted(BUILTIN_PREFIX + k for k in [*TINY_MODELS, *GGUF_MODELS])
        raise ConfigError(f"unknown builtin model {name!r}; choose one of {choices}")
    return TINY_MODELS[key]


def build_tiny_model(name: str, tokenizer, dtype=None):
    """A randomly initialized model of spec ``name`` (drawn from the current torch RNG)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(get_spec(name), tokenizer)
    return AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)


def build_tiny(name: str, dtype=None):
    """``(model, tokenizer)`` for ``name`` (with or without the ``builtin:`` prefix).

    Weights are drawn from the current torch RNG: seed first for a reproducible model.
    """
    tokenizer = build_tokenizer(get_spec(name))
    return build_tiny_model(name, tokenizer, dtype), tokenizer


def save_tiny(name: str, out_dir: str | Path) -> Path:
    """Build ``name`` and save it as a normal Hugging Face checkpoint folder."""
    model, tokenizer = build_tiny(name)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
