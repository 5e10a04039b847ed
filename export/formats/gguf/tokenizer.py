"""The tokenizer inside a .gguf file: llama.cpp's `tokenizer.ggml.*` keys for a byte-level BPE
tokenizer (tokenizer.ggml.model "gpt2"), read from the Hugging Face tokenizer's tokenizer.json."""
from __future__ import annotations

import json

# llama.cpp's token types (llama_token_type)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# tokenizer.json pre-tokenizers llama.cpp knows by a `tokenizer.ggml.pre` name (llama-vocab.cpp's
# regexes for these names are the same splits): a key is the pre-tokenizer's shape, see _shape().
_LLAMA3 = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
           "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN2 = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
          "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
PRE_TOKENIZERS = {
    ("ByteLevel:regex",): "gpt-2",
    ("Digits:individual", "ByteLevel:regex"): "smollm",
    (f"Split:{_LLAMA3}", "ByteLevel"): "llama-bpe",
    (f"Split:{_QWEN2}", "ByteLevel"): "qwen2",
}


def add_tokenizer(writer, tokenizer, vocab_size: int, where: str) -> None:
    """Vocabulary (padded to the model's vocab_size), token types, merges, special ids, chat template."""
    data = _tokenizer_json(tokenizer, where)
    model = data["model"]
    if model.get("type") != "BPE" or _shape(data.get("pre_tokenizer")) is None:
        raise ValueError(f"{where}: GGUF export writes byte-level BPE tokenizers (llama.cpp's 'gpt2' model); "
                         f"this one is {model.get('type')!r} with pre-tokenizer {_describe(data.get('pre_tokenizer'))}")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZERS[_shape(data["pre_tokenizer"])])
    tokens, types = vocabulary(data, vocab_size, where)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    _add_special_ids(writer, tokenizer)
    writer.add_add_bos_token(_adds_bos(tokenizer))  # llama.cpp then prepends BOS as the tokenizer does
    writer.add_add_space_prefix(False)
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def vocabulary(data: dict, vocab_size: int, where: str) -> tuple[list[str], list[int]]:
    """Token strings by id and their llama.cpp types: added special tokens CONTROL, other added
    tokens USER_DEFINED, ids past the tokenizer up to the model's vocab_size '[PADn]' UNUSED."""
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    by_id.update({i: t["content"] for i, t in added.items()})
    if max(by_id) >= vocab_size:
        raise ValueError(f"{where}: the tokenizer has token id {max(by_id)}, beyond the model's vocab_size "
                         f"{vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(NORMAL)
    return tokens, types


def _add_special_ids(writer, tokenizer) -> None:
    for attr, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("unk_token_id", writer.add_unk_token_id), ("pad_token_id", writer.add_pad_token_id)):
        token_id = getattr(tokenizer, attr, None)
        if token_id is not None:
            add(token_id)


def _adds_bos(tokenizer) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos is not None and len(ids) > 0 and ids[0] == bos


def _tokenizer_json(tokenizer, where: str) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{where}: GGUF export needs a fast (tokenizer.json) tokenizer; got "
                         f"{type(tokenizer).__name__}")
    return json.loads(backend.to_str())


def _shape(pre: dict | None) -> tuple[str, ...] | None:
    """The pre-tokenizer as the key PRE_TOKENIZERS knows it by, or None when it is not one of those."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    shape = []
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            shape.append("ByteLevel:regex" if step.get("use_regex", True) else "ByteLevel")
        elif kind == "Digits":
            shape.append("Digits:individual" if step.get("individual_digits") else "Digits")
        elif kind == "Split":
            shape.append(f"Split:{(step.get('pattern') or {}).get('Regex')}")
        else:
            shape.append(str(kind))
    return tuple(shape) if tuple(shape) in PRE_TOKENIZERS else None


def _describe(pre: dict | None) -> str:
    return json.dumps(pre)[:200] + f" (supported: {', '.join(sorted(set(PRE_TOKENIZERS.values())))})"
