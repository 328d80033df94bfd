"""The export's tokenizer: loaded natively by transformers for each type, and generate() stops at the EOD."""

import base64
from pathlib import Path

import pytest
import torch

from megatron_lc.arguments import parse_config
from megatron_lc.data.tokenizers import build_tokenizer, train_sentencepiece
from megatron_lc.training.hf_conversion import checkpoint_to_hf
from megatron_lc.training.trainer import train

transformers = pytest.importorskip("transformers")
TEXT = "the token in the thing, to think: tokens then the end.\n" * 20


def _tokenizer_json(tmp_path: Path) -> str:
    """A byte-level BPE whose end-of-text is id 0 (the exported eos must not be transformers' default 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TEXT], trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def _tiktoken_file(tmp_path: Path) -> str:
    """Llama-3-format BPE ranks: the 256 bytes and a few merges (the 256 specials follow them)."""
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" t", b" the", b"in", b"ng", b"ing"]
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return str(path)


def _sentencepiece(tmp_path: Path) -> str:
    return train_sentencepiece(TEXT.splitlines() * 5, tmp_path / "spm", vocab_size=300)


class _EndAfter(transformers.LogitsProcessor):
    """Makes the EOD the only choice once `n` tokens were generated."""

    def __init__(self, start: int, n: int, eod: int):
        self.stop_at, self.eod = start + n, eod

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] >= self.stop_at:
            scores[:] = -float("inf")
            scores[:, self.eod] = 0
        return scores


@pytest.mark.parametrize("kind, make", [("HuggingFaceTokenizer", _tokenizer_json), ("TikTokenizer", _tiktoken_file),
                                        ("SentencePieceTokenizer", _sentencepiece)])
def test_export_ships_a_native_tokenizer_and_generate_stops_at_the_eod(tmp_path, kind, make):
    model_file = make(tmp_path)
    ours = build_tokenizer(kind, model_file)
    train(parse_config(["--mock-data", "--seq-length", "16", "--train-iters", "1", "--device", "cpu",
                        "--tokenizer-type", kind, "--tokenizer-model", model_file,
                        "--save", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "log")]))
    hf_dir = checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype=torch.float32)  # the run's tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert theirs.is_fast and theirs.eos_token_id == ours.eod and theirs.bos_token_id == ours.bos
    text = "the thing in the end"
    assert theirs.encode(text, add_special_tokens=False) == ours.tokenize(text)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert model.generation_config.eos_token_id == ours.eod and model.config.eos_token_id == ours.eod
    prompt = torch.tensor([ours.tokenize(text)])
    out = model.generate(prompt, max_new_tokens=12, do_sample=False,
                         logits_processor=transformers.LogitsProcessorList([_EndAfter(prompt.shape[1], 3, ours.eod)]))
    assert out.shape[1] == prompt.shape[1] + 4 and out[0, -1].item() == ours.eod  # 3 tokens, then the EOD: stopped


def test_a_chat_tokenizers_template_travels_with_the_export(tmp_path):
    """A fine-tuned chat model is used through its chat template: the export renders conversations exactly as
    the tokenizer it was trained with."""
    from megatron_lc.testing import write_chat_tokenizer
    from megatron_lc.training.hf_conversion import save_tokenizer

    source = write_chat_tokenizer(tmp_path / "tok", ["red green blue north south"] * 20, vocab_size=300)
    save_tokenizer(str(source), str(tmp_path / "out"), "HuggingFaceTokenizer")
    messages = [{"role": "system", "content": "Reverse."}, {"role": "user", "content": "red blue"}]
    theirs = transformers.AutoTokenizer.from_pretrained(str(source))
    ours = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert ours.chat_template == theirs.chat_template
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == \
        theirs.apply_chat_template(messages, add_generation_prompt=True)
