"""What a Hugging Face export needs besides weights to generate as its source did: the source's
generation_config.json (its eos list, such as Llama 3.1 Instruct's `[<|end_of_text|>, <|eom_id|>, <|eot_id|>]`,
and its sampling defaults) and its tokenizer's special-token map, kept by `convert_from_hf.py` in the checkpoint's
meta and written back by `convert_to_hf.py`; and the check that `generate()` stops where the chat template ends
an assistant turn."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
META_GENERATION_CONFIG = "hf_generation_config"  # checkpoint meta key: the source's generation_config.json
META_SPECIAL_TOKENS = "hf_special_tokens"  # checkpoint meta key: the source tokenizer's special-token map
# Keys of a generation config that describe the file, not generation: never carried over.
_FILE_KEYS = ("transformers_version", "_from_model_config")


def read_generation_config(directory: str | Path | None) -> dict[str, Any] | None:
    """A directory's generation_config.json as a dict (None where there is none)."""
    if directory is None or not Path(directory).is_dir():
        return None
    path = Path(directory) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return None
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in _FILE_KEYS}


def read_special_tokens(directory: str | Path) -> dict[str, Any] | None:
    """The special-token map (bos, eos, pad, unk, ... and extra special tokens) of a directory's tokenizer, as
    transformers loads it; None where the directory holds no tokenizer."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                          "tokenizer.model")):
        return None
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return {key: value for key, value in tokenizer.special_tokens_map.items() if value}


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def export_generation_config(hf_config: Any, source: dict[str, Any] | None, eos: int | None) -> Any:
    """The export's GenerationConfig: the model config's ids, then the source's fields (its eos list and
    sampling defaults) over them, the training's end of document kept among the eos ids."""
    import transformers

    generation = transformers.GenerationConfig.from_model_config(hf_config)
    if not source:
        return generation
    fields = dict(source)
    eos_ids = _as_list(fields.pop("eos_token_id", None))
    if eos is not None and eos not in eos_ids:
        eos_ids.append(eos)
    for key, value in fields.items():
        setattr(generation, key, value)
    if eos_ids:
        generation.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    return generation


def end_of_turn(tokenizer: Any) -> tuple[str, int] | None:
    """The token the chat template writes right after an assistant message's content (its end of turn), as
    (text, id); None without a template or where it writes no added token there."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "EXPORT_CHECK_ANSWER"
    messages = [{"role": "user", "content": "question"}, {"role": "assistant", "content": marker}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that needs more than a plain exchange: nothing to check against
        return None
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    added = {token.content: token_id for token_id, token in tokenizer.added_tokens_decoder.items()}
    for token_id in tokenizer.encode(after, add_special_tokens=False):
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token in added:
            return token, token_id
    return None


def eos_misses_end_of_turn(directory: Path, named: Path) -> str | None:
    """One line (naming the export `named`) where the eos ids of the export written in `directory`
    (generation_config.json) leave out the chat template's end of turn: `generate()` would run past each answer."""
    import transformers

    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    found = end_of_turn(tokenizer)
    generation = read_generation_config(directory) or {}
    eos_ids = _as_list(generation.get("eos_token_id"))
    if found is None or found[1] in eos_ids:
        return None
    names = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)} ({i})" for i in eos_ids) or "none"
    return (f"{named}: generation_config.json's eos is {names}, but the chat template ends an assistant turn with "
            f"{found[0]} ({found[1]}): generate() will not stop at the end of an answer; export with the source's "
            "generation_config.json (convert_from_hf.py keeps it; or a --tokenizer-model directory holding it)")
