"""The command line of `preprocess.py` (`tools/preprocess_data.py`): Megatron's flags, the checks that can be made
before any document is read, and the exit codes."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from megatron_lc.command_line import ArgumentParser, check_writable, report_tool_error
from megatron_lc.data import preprocess as preprocess_module
from megatron_lc.data.chat_records import CHAT_DOCUMENTS_CHOICES, LOSS_ON_CHOICES, OWN_TEMPLATE, ChatSettings
from megatron_lc.data.corpus import InvalidInputError
from megatron_lc.data.encode import PIECE_CHARS, cached_chat_encoder, cached_tokenizer
from megatron_lc.data.preprocess import PreprocessOptions, encode_config, input_files, preprocess
from megatron_lc.data.sentences import sentence_splitter
from megatron_lc.data.tokenizers import TOKENIZER_TYPES
from megatron_lc.errors import ConfigError

# Tokenizer memory per character of one document encoded whole, the largest measured: a tokenizer.json
# byte-level BPE, 189 B per character on an 8M-character document (bench/bench_tokenizer_memory.py;
# SentencePiece 46 B, GPT2BPETokenizer 64 B, tiktoken 11 B): the default --max-document-chars gives each
# tokenizing process its share of RAM at this rate, for the tokenizers that do not cut long documents.
TOKENIZER_BYTES_PER_CHAR = 190


def default_max_document_chars(processes: int) -> int:
    """Characters of one document that each of `processes` tokenizing processes can hold in its share of this
    machine's RAM at `TOKENIZER_BYTES_PER_CHAR`."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # no sysconf: no limit rather than a guessed one
        return 0
    return ram // max(1, processes) // TOKENIZER_BYTES_PER_CHAR


def check_options(options: PreprocessOptions) -> None:
    """What can be known wrong before any document is read, as a `ConfigError` naming the flag: sizes, the
    inputs, the tokenizer and its special tokens, and the output directory."""
    for name, value in (("--workers", options.workers), ("--partitions", options.partitions),
                        ("--log-interval", options.log_interval)):
        if value < 1:
            raise ConfigError(f"{name} {value} must be >= 1")
    if options.max_document_chars is not None and options.max_document_chars < 1:
        raise ConfigError(f"--max-document-chars {options.max_document_chars} must be >= 0 (0: no limit)")
    try:
        if not input_files(options, announce=False):
            raise ConfigError(f"--input {' '.join(options.inputs)}: no input file (only this run's own output)")
        encode_config(options, cached_tokenizer(options.tokenizer))
        if options.split_sentences:
            sentence_splitter(options.lang, options.keep_newlines)
        if options.chat is not None:
            check_chat_options(options)
    except (InvalidInputError, ValueError, OSError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(str(error)) from error
    check_writable(os.path.dirname(os.path.abspath(options.output_prefix)), "--output-prefix")
    if options.keep_newlines and not options.split_sentences:
        print("preprocess_data: note: --keep-newlines has no effect without --split-sentences (as in Megatron-LM)",
              file=sys.stderr)


def check_chat_options(options: PreprocessOptions) -> None:
    """--chat-template's needs, as a `ConfigError` naming the flag: a transformers tokenizer, one conversation
    key (or a prompt and a completion key), no flag that would add tokens to `apply_chat_template`'s ids, and a
    template that loads."""
    flag = f"--chat-template {options.chat.template}"
    if options.tokenizer_type != "HuggingFaceTokenizer":
        raise ConfigError(f"{flag} needs --tokenizer-type HuggingFaceTokenizer (a local tokenizer directory "
                          f"transformers loads), not {options.tokenizer_type}")
    if len(options.json_keys) > 2:
        raise ConfigError(f"{flag}: --json-keys names one conversation field (messages, conversations) or a prompt "
                          f"and a completion field, not {len(options.json_keys)} fields")
    for name, given in (("--append-eod", options.append_eod), ("--prepend-bos", options.prepend_bos),
                        ("--split-sentences", options.split_sentences)):
        if given:
            raise ConfigError(f"{name} with {flag}: a document's ids are exactly the template's rendering "
                              "(its own begin-of-text and end-of-turn tokens); drop the flag")
    if options.chat.template_file is not None and not os.path.isfile(options.chat.template_file):
        raise ConfigError(f"{flag}: no such file (give a Jinja template file, or {OWN_TEMPLATE} for the tokenizer's own)")
    cached_chat_encoder(options.tokenizer, options.chat)  # the tokenizer loads and the template parses


def build_parser() -> argparse.ArgumentParser:
    """Megatron's preprocess_data.py flags, plus a few for bad input and partitions."""
    parser = ArgumentParser(prog="preprocess_data.py", description=preprocess_module.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input")
    group.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files, globs or directories: .jsonl/.json, .parquet, "
        "datasets save_to_disk directories; any other file is one plain-text document",
    )
    group.add_argument(
        "--json-keys", nargs="+", default=["text"], help="fields to tokenize, one dataset each (default: text)"
    )
    group.add_argument("--split", default="train", help="split read from a saved DatasetDict (default: train)")
    group.add_argument(
        "--chat-template", metavar="{hf,FILE.jinja}",
        help="read conversations, not text: --json-keys names a list of OpenAI messages ({role, content}) or of "
        "ShareGPT turns ({from, value}), or a prompt and a completion field; each document's ids are exactly "
        "tokenizer.apply_chat_template(messages) with the tokenizer's own template (hf) or FILE.jinja; writes "
        "PREFIX_{key}_document and its loss mask PREFIX_{key}_document_loss_mask (docs/sft.md). Needs "
        "--tokenizer-type HuggingFaceTokenizer")
    group.add_argument(
        "--loss-on", choices=LOSS_ON_CHOICES, default=None,
        help="with --chat-template: the tokens trained on; assistant (default): each assistant message's "
        "content and end of turn, written as a loss mask; last: the last assistant message's only (a template "
        "that rewrites earlier turns, as Qwen3's drops past reasoning, renders the last as it is trained); all: "
        "every token, no mask written")
    group.add_argument(
        "--chat-documents", choices=CHAT_DOCUMENTS_CHOICES, default=None,
        help="with --chat-template: conversation (default): one document per record; turn: one document per "
        "trained turn, the messages up to it rendered as the template renders a conversation that ends there, "
        "only that turn trained (every turn of a template that rewrites history, each as it was generated)")
    group.add_argument(
        "--train-key", default=None, metavar="KEY",
        help="with --chat-template: a message's own training flag (true/false or 1/0) under KEY overrides "
        "--loss-on for that message, any role (axolotl's message_field_training, ms-swift's loss); without it a "
        "message holding a training-flag-like key (train, training, loss, weight, ...) is refused")
    group.add_argument(
        "--chat-template-kwargs-keys", nargs="+", default=(), metavar="KEY",
        help="with --chat-template: record fields passed to the template as keywords, as "
        "apply_chat_template(messages, tools=record['tools']) (e.g. tools, documents); a record holding tools or "
        "documents not named here is refused")
    group.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip and count malformed lines, invalid UTF-8, missing keys, non-string values and invalid "
        "conversations instead of stopping at the first; every skipped record's file:line is listed in "
        "PREFIX_skipped.tsv",
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument(
        "--tokenizer-model", help="SentencePiece .model, tokenizer.json (or its directory), tiktoken BPE file"
    )
    group.add_argument("--vocab-file", help="GPT2BPETokenizer: its vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer: its merges.txt")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer: ids 0..N-1 in the text, EOD = N")
    group.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    group.add_argument("--split-sentences", action="store_true",
                       help="one sequence per sentence (nltk Punkt, as Megatron-LM), written as "
                       "PREFIX_{key}_sentence.{bin,idx}; documents stay documents in the index")
    group.add_argument("--keep-newlines", action="store_true",
                       help="with --split-sentences: keep the newlines after a sentence in it")
    group.add_argument("--lang", default="english", help="Punkt model for --split-sentences (default: english)")
    group.add_argument("--prepend-bos", action="store_true", help="start every document with the BOS token")
    group = parser.add_argument_group("output and runtime")
    group.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.{bin,idx}")
    group.add_argument(
        "--workers",
        type=int,
        default=1,
        help="tokenizer processes (default: 1, which tokenizes in the reading process)",
    )
    group.add_argument(
        "--partitions", type=int, default=1, help="process groups of input files in parallel, then merge"
    )
    group.add_argument(
        "--log-interval", type=int, default=1000, help="documents between progress lines when not on a terminal"
    )
    group.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    group.add_argument(
        "--max-document-chars", type=int, default=None,
        help="for a tokenizer that encodes documents whole (SentencePiece, a tokenizer.json that cannot be cut "
        "exactly, NullTokenizer, ByteTokenizer; any with --split-sentences): a longer document is refused (or "
        "skipped with --skip-invalid), naming it, instead of the tokenizer running out of memory (default: RAM / "
        f"tokenizing processes / {TOKENIZER_BYTES_PER_CHAR} B per character; 0: no limit). Not applied to "
        "tiktoken, GPT2BPETokenizer and a byte-level BPE tokenizer.json of GPT-2's, Llama 3's or Qwen2's pattern: "
        f"they encode a document over {PIECE_CHARS:,} characters in exact pieces, at any length")
    return parser


def options_from_args(args: argparse.Namespace) -> PreprocessOptions:
    """The parsed flags as options."""
    return PreprocessOptions(
        inputs=tuple(args.input),
        output_prefix=args.output_prefix,
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        json_keys=tuple(args.json_keys),
        workers=args.workers,
        partitions=args.partitions,
        append_eod=args.append_eod,
        prepend_bos=args.prepend_bos,
        skip_invalid=args.skip_invalid,
        log_interval=args.log_interval,
        split=args.split,
        show_progress=not args.no_progress,
        max_document_chars=_max_document_chars(args),
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        lang=args.lang,
        chat=_chat_settings(args),
    )


def _chat_settings(args: argparse.Namespace) -> ChatSettings | None:
    """--chat-template and the flags that shape its documents; any of them alone is refused (plain text has no
    turns: every token is trained on), and so is a per-turn flag with --loss-on all."""
    given = {"--loss-on": args.loss_on, "--chat-documents": args.chat_documents, "--train-key": args.train_key,
             "--chat-template-kwargs-keys": " ".join(args.chat_template_kwargs_keys) or None}
    if args.chat_template is None:
        for name, value in given.items():
            if value is not None:
                raise ConfigError(f"{name} {value} needs --chat-template (plain text has no turns: every token is "
                                  "trained on)")
        return None
    if args.loss_on == "all":
        for name in ("--chat-documents", "--train-key"):
            if given[name] is not None:
                raise ConfigError(f"{name} {given[name]} with --loss-on all: every token is trained, no turn is "
                                  "chosen; use --loss-on assistant or last")
    return ChatSettings(args.chat_template, args.loss_on or "assistant", args.chat_documents or "conversation",
                        args.train_key, tuple(args.chat_template_kwargs_keys))


def _max_document_chars(args: argparse.Namespace) -> int | None:
    """The flag's value, its default from RAM when not given, None for no limit."""
    if args.max_document_chars is None:
        return default_max_document_chars(max(args.workers, args.partitions)) or None
    return None if args.max_document_chars == 0 else args.max_document_chars  # a negative one is refused later


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: 0 on success; one line and 2 for a command line that cannot work (checked
    before reading), 1 for bad input found while reading (`file:line`) or a failed write (the path, the OS's
    reason)."""
    try:
        options = options_from_args(build_parser().parse_args(argv))
        check_options(options)
    except ConfigError as error:
        return report_tool_error("preprocess_data", error)
    try:
        summary = preprocess(options)
    except (InvalidInputError, ValueError) as error:
        print(f"preprocess_data: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # a full disk, a vanished directory: the path and the OS's reason
        where = error.filename or options.output_prefix
        print(f"preprocess_data: error: {where}: {error.strerror or error} (nothing written: the partial output "
              "was removed)", file=sys.stderr)
        return 1
    print(summary.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
