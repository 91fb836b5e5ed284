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
    # a vision-language model (Qwen2.5-VL's architecture): the vision tower's shape, and the side
    # in pixels every image is resized to (``models/vision.py`` renders images for it)
    vision: Optional[dict] = None
    image_side: int = 56


ECHO_WORDS = ("repeat", *[str(d) for d in range(10)])
SUCCESSOR_WORDS = ("next", *[str(d) for d in range(10)])
# the lookup task's episodes (data/tasks/lookup.py): chat roles as words, a tool, six keys, digits
LOOKUP_WORDS = ("user:", "assistant:", "tool:", "find", "get", "error", "a", "b", "c", "d", "e", "f", *[str(d) for d in range(10)])

# the vision-language chat: an image part is the vision tokens around one image placeholder, which the
# image renderer (models/vision.py) expands to the image's number of merged patches. The newline after
# a message is an expression: transformers renders templates with trim_blocks, which drops a newline
# right after a block tag
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")  # vLLM's Qwen-VL reads
# the video token from the vocabulary even for images
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
COLOUR_WORDS = ("colour", "where", "red", "green", "blue", "yellow", "left", "right", "top", "bottom", "user:", "assistant:",
                "tool:")
# a vision tower of 2 blocks over 14-pixel patches, 2x2 patches merged into one language token:
# a 56-pixel image is 16 patches and 4 tokens
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1], in_channels=3)

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
    # a vision-language model (Qwen2.5-VL's architecture, 0.16M parameters) for the colour task
    # (data/tasks/colours.py, configs/quickstart_vlm.yaml): heads of 32 dims, M-RoPE over 16 of them
    "tiny-vlm": TinyModelSpec(words=COLOUR_WORDS, model_type="qwen2_5_vl", num_attention_heads=2, num_key_value_heads=1,
                              vision=TINY_VISION, chat_template=VLM_CHAT_TEMPLATE,
                              extra_config=dict(rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6],
                                                                 "rope_theta": 10000.0})),
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


def _wrap_tokenizer(tok, chat_template: str = CHAT_TEMPLATE, extra_special: tuple[str, ...] = ()):
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        **({"extra_special_tokens": list(extra_special)} if extra_special else {}),
    )
    wrapped.chat_template = chat_template
    wrapped.padding_side = "left"
    return wrapped


def build_tokenizer(spec: TinyModelSpec):
    """A ``PreTrainedTokenizerFast`` for the spec; spaces survive a round trip."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if spec.tokenizer == "words":
        extra = VISION_TOKENS if spec.vision else ()
        vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *extra, *spec.words])}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        if extra:  # matched before the whitespace split: "<|vision_start|><|image_pad|>" is two tokens
            tok.add_special_tokens(list(extra))
        # WordLevel has no decoder of its own: the default joins tokens with single spaces
        return _wrap_tokenizer(tok, spec.chat_template, extra)
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
    if spec.vision:
        return _vision_language_config(spec, tokenizer, vocab_size)
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


def _vision_language_config(spec: TinyModelSpec, tokenizer, vocab_size: int):
    """A Qwen2.5-VL config: the text model of the spec and its vision tower."""
    from transformers import AutoConfig

    start, image, end, video = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    text = dict(vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
                num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
                tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=None, **spec.extra_config)
    return AutoConfig.for_model(
        spec.model_type, text_config=text, vision_config={**spec.vision, "out_hidden_size": spec.hidden_size},
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )


def build_image_processor(spec: TinyModelSpec):
    """The image processor of a builtin vision-language model: every image resized to
    ``image_side`` pixels square (its patches and merge size from the vision tower)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = spec.image_side * spec.image_side
    return Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=spec.vision["patch_size"],
                                    merge_size=spec.vision["spatial_merge_size"],
                                    temporal_patch_size=spec.vision["temporal_patch_size"])


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
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    spec = get_spec(name)
    auto = AutoModelForImageTextToText if spec.vision else AutoModelForCausalLM
    return auto.from_config(build_config(spec, tokenizer), dtype=dtype or torch.float32)


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
    if get_spec(name).vision:
        build_image_processor(get_spec(name)).save_pretrained(out)
    return out
