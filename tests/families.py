"""Tiny random models of every family quickdraft runs, as Hugging Face transformers builds them (for
tests/test_families.py and tests/test_cuda.py)."""

from pathlib import Path

import torch
import transformers

TOKENS = [5, 17, 250, 3, 99, 42, 7, 311, 64, 128, 1, 200, 13, 77, 9, 150, 31, 260]
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def configs() -> dict:
    """Tiny configs of each family, each exercising what is particular to it (windows shorter than TOKENS)."""
    gemma_rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    return {
        "llama3": transformers.LlamaConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}, rope_theta=500000.0),
        "llama3-tied": transformers.LlamaConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=True),
        "mistral": transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=None),
        "mistral-window": transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=5),
        "phi3": transformers.Phi3Config(**COMMON, num_hidden_layers=2, partial_rotary_factor=0.75,
                                        original_max_position_embeddings=32, rope_scaling={
                                            "type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.0, 2.5, 3.0],
                                            "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}),
        "gemma2": transformers.Gemma2Config(**COMMON, num_hidden_layers=3, head_dim=16, sliding_window=5,
                                            query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                                            final_logit_softcapping=30.0),
        "gemma3": transformers.Gemma3TextConfig(**COMMON, num_hidden_layers=6, head_dim=16, sliding_window=5,
                                                query_pre_attn_scalar=16, rope_parameters=gemma_rope),
        # gemma4: wider heads with values from the keys on full layers, proportional rotary there, the last two
        # layers reusing layers 2 (sliding) and 3 (full)'s keys and values with a double-wide FFN, per-layer inputs
        "gemma4": transformers.Gemma4TextConfig(
            **COMMON, num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=5,
            layer_types=["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=320, attention_k_eq_v=True,
            num_global_key_value_heads=1, num_kv_shared_layers=2, use_double_wide_mlp=True,
            final_logit_softcapping=30.0, rope_parameters={
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    }


# which families llama.cpp's converter takes as they are here (mistral's window is lost in GGUF: llama.cpp's llama
# arch has none, so the windowed one is checked from its Hugging Face directory only)
CONVERTED = ["llama3", "llama3-tied", "mistral", "phi3", "gemma2", "gemma3", "gemma4"]
FAMILIES = list(configs())


def tiny_model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(configs()[name], attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():  # random init leaves norms at their identity and biases at 0: make every parameter matter
        for pname, p in model.named_parameters():
            if "norm" in pname:  # gemma2 and gemma3 scale by 1 + w
                p.copy_((0.0 if name in ("gemma2", "gemma3") else 1.0) + 0.1 * torch.randn_like(p))
            elif pname.endswith("layer_scalar"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def spm_tokenizer(directory: Path) -> None:
    """A SentencePiece tokenizer.model of the tiny vocabulary (what llama.cpp's converter reads for these)."""
    import random

    import sentencepiece as spm

    rng = random.Random(0)
    words = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "model", "draft"]
    text = directory / "corpus.txt"
    text.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(directory / "tokenizer"), vocab_size=320,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2,
                                   unk_id=0, pad_id=-1, minloglevel=2)
    text.unlink()
    (directory / "tokenizer.vocab").unlink()


def save(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    spm_tokenizer(directory)
    if model.config.model_type == "gemma4_text":  # llama.cpp's converter reads gemma4's tokenizer.json
        transformers.LlamaTokenizer.from_pretrained(directory).save_pretrained(directory / "tok")  # its 320 tokens
        (directory / "tok" / "tokenizer.json").rename(directory / "tokenizer.json")
        return directory
    from tokenizers import Tokenizer, models as tok_models

    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}  # quickdraft reads tokenizer.json
    Tokenizer(tok_models.WordLevel(vocab, unk_token="t0")).save(str(directory / "tokenizer.json"))
    return directory


def bpe_tokenizer(directory: Path, vocab_size: int = 320) -> None:
    """A byte-level BPE tokenizer.json of the tiny vocabulary (256 bytes, merges learnt on a small corpus of English
    and Chinese words, <|endoftext|>), as Qwen's models have: what llama.cpp's converter reads for qwen3.5 and MoE."""
    import json
    import random

    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "model", "draft", "你好",
             "世界"]
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator([" ".join(rng.choice(words) for _ in range(12)) for _ in range(500)], trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                 "eos_token": "<|endoftext|>"}))
