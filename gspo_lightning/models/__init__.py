"""Models: loading the policy and its tokenizer (hub id, folder, ``builtin:``, GGUF), the tiny
models built locally (``builtin:tiny-*``), the KV cache's name across transformers versions and
its rows, grouped-query attention on CPU, Mixture-of-Experts routing, LoRA adapters."""

from gspo_lightning._imports import lazy_exports

EXPORTS = {
    **dict.fromkeys(["load_policy", "load_tokenizer", "eos_token_ids", "check_model_source"], "loading"),
    **dict.fromkeys(["ModelSourceError", "resolve_model", "is_gguf_builtin"], "gguf"),
    **dict.fromkeys(["cache_kwargs", "output_cache", "select_cache_rows"], "hf_cache"),
    "group_attention_on_cpu": "cpu_attention",
    **dict.fromkeys(["LoRA", "attach_lora", "adapters_disabled", "merged_state_dict", "save_adapter"], "lora"),
    **dict.fromkeys(["hub_reachable", "go_offline"], "hub"),
    **dict.fromkeys(["TINY_MODELS", "build_tiny", "save_tiny"], "tiny"),
    **dict.fromkeys(["RoutingRecorder", "RoutingChange", "RouterLogitsCapture", "load_balancing_loss"], "moe"),
}
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
