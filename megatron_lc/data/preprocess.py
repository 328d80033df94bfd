"""Tokenize raw corpora into Megatron indexed datasets (`PREFIX_{key}_document.{bin,idx}`).

Every document's ids are exactly the tokenizer's encoding of the whole document. A document of
more than `PIECE_CHARS` characters is encoded piece by piece where the tokenizer's pre-tokenization
makes the cuts provably exact (tiktoken, GPT2BPETokenizer, a byte-level BPE `tokenizer.json` of a
known pattern: `Tokenizer.cuts_long_documents`), so its memory is bounded by a piece; any other is
encoded whole, in one call (a unigram model's Viterbi pass, for one, is not local, so pieces encoded
apart can differ anywhere), and `--max-document-chars` guards against the largest. The main
process reads documents and groups consecutive ones into tasks; `--workers` processes
encode tasks; the main process writes the results in input order. At most a few tasks
are in flight, so memory stays bounded by a few tasks and the largest document.
With `--chat-template`, a document is a conversation: its ids are exactly `apply_chat_template`'s, and a loss
mask is written beside them (`chat.py`, `loss_mask.py`; docs/sft.md). With `--skip-invalid`, every skipped
record is listed in `PREFIX_skipped.tsv`. `tools/preprocess_data.py` is the command line.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from megatron_lc.data.chat_records import ChatSettings
from megatron_lc.data.corpus import BytesRead, InputProblems, ProblemCount, ReadOptions, expand_inputs, read_documents
from megatron_lc.data.document_locations import LocationsWriter, locations_path, remove_locations
from megatron_lc.data.encode import EncodeConfig, EncodedKey, TokenizerPool, cached_tokenizer, group_documents
from megatron_lc.data.indexed_dataset import (
    IndexedDatasetBuilder,
    bin_path,
    idx_path,
    optimal_dtype,
    remove_dead_temporaries,
    temporary_path,
)
from megatron_lc.data.loss_mask import LOSS_MASK_DTYPE, loss_mask_prefix, merge_with_loss_masks, remove_dataset_files
from megatron_lc.data.partition_manifest import input_identity, path_digest, verified_summary, write_manifest
from megatron_lc.data.preprocess_progress import Progress
from megatron_lc.data.tokenizers import Tokenizer, TokenizerSpec

class NoDocumentsError(ValueError):
    """The inputs hold no text under the keys: nothing is written."""


@dataclass(frozen=True)
class PreprocessOptions:
    """Everything `preprocess` needs; the command-line flags map one to one."""

    inputs: tuple[str, ...]
    output_prefix: str
    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None  # GPT2BPETokenizer's vocab.json
    merge_file: str | None = None  # GPT2BPETokenizer's merges.txt
    vocab_size: int | None = None  # NullTokenizer's N
    json_keys: tuple[str, ...] = ("text",)
    workers: int = 1
    partitions: int = 1
    append_eod: bool = False
    prepend_bos: bool = False
    skip_invalid: bool = False
    log_interval: int = 1000
    split: str = "train"
    show_progress: bool = True
    max_document_chars: int | None = None  # None: no limit
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    chat: ChatSettings | None = None  # --chat-template, --loss-on

    @property
    def tokenizer(self) -> TokenizerSpec:
        return TokenizerSpec(self.tokenizer_type, self.tokenizer_model, self.vocab_file, self.merge_file,
                             self.vocab_size)

    @property
    def level(self) -> str:
        """Megatron's dataset name level: one sequence per sentence or per document."""
        return "sentence" if self.split_sentences else "document"

    @property
    def dataset_keys(self) -> tuple[str, ...]:
        """The name of each dataset written: one per JSON key; one per conversation with --chat-template (its two
        keys joined for prompt/completion records)."""
        return ("_".join(self.json_keys),) if self.chat is not None else self.json_keys

    @property
    def masked(self) -> bool:
        """Whether a loss mask is written beside the ids."""
        return self.chat is not None and self.chat.masked

    @property
    def skipped_path(self) -> str | None:
        """With --skip-invalid: where every skipped record's location is written."""
        return skipped_log_path(self.output_prefix) if self.skip_invalid else None


def output_prefix_for(output_prefix: str, key: str, level: str = "document") -> str:
    """Megatron's naming: one dataset per JSON key, `_sentence` with --split-sentences."""
    return f"{output_prefix}_{key}_{level}"


def dataset_prefixes(options: PreprocessOptions) -> list[str]:
    """The output prefix of every dataset (`PreprocessOptions.dataset_keys`)."""
    return [output_prefix_for(options.output_prefix, key, options.level) for key in options.dataset_keys]


def skipped_log_path(output_prefix: str) -> str:
    """Where --skip-invalid lists every skipped record: `location<TAB>reason<TAB>detail` lines."""
    return f"{output_prefix}_skipped.tsv"


class SkippedLog:
    """The skipped records' lines, written to a temporary file and moved into place by `finalize` (removed
    unless finalized); nothing at all without a path."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.stream = None
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            remove_dead_temporaries(path)
            self._temporary = temporary_path(path)
            self.stream = open(self._temporary, "w", encoding="utf-8")

    def __enter__(self) -> "SkippedLog":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None and self.stream is not None:
            self.stream.close()
            os.remove(self._temporary)

    def finalize(self, files: Sequence[str] = ()) -> None:
        """Move the list into place; with `files`, its lines first put in input order (a record the chat template
        refused is found when its task is encoded, after the reading has passed later records)."""
        if self.stream is None:
            return
        self.stream.close()
        if files:
            order = {path: index for index, path in enumerate(files)}
            with open(self._temporary, encoding="utf-8") as stream:
                lines = sorted(stream, key=lambda line: _input_position(line.split("\t", 1)[0], order))
            with open(self._temporary, "w", encoding="utf-8") as stream:
                stream.writelines(lines)
        os.replace(self._temporary, self.path)


def _input_position(location: str, order: dict[str, int]) -> tuple[int, int]:
    """A location's (file index, line/row/item number), from `Location`'s text (`path:N`, `path:row N`)."""
    path, _, where = location.rpartition(":")
    number = where.rsplit(" ", 1)[-1]
    return order.get(path, len(order)), int(number) if number.isdigit() else 0


def concatenate_skipped_logs(parts: Sequence[str], path: str) -> None:
    """The partitions' skipped lists as one, in input order (a temporary renamed into place)."""
    with SkippedLog(path) as log:
        for part in parts:
            with open(part, encoding="utf-8") as stream:
                shutil.copyfileobj(stream, log.stream)
        log.finalize()


class DatasetWriters:
    """One builder per dataset (with `masked`, one more for its loss mask); removes partial files unless
    finalized."""

    def __init__(self, prefixes: Sequence[str], dtype: type[np.number], masked: bool = False) -> None:
        self.prefixes = list(prefixes)
        self.builders: list[IndexedDatasetBuilder] = []
        self.mask_builders: list[IndexedDatasetBuilder] = []
        for prefix in self.prefixes:
            os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
            self.builders.append(IndexedDatasetBuilder(bin_path(prefix), dtype=dtype))
            if masked:
                self.mask_builders.append(IndexedDatasetBuilder(bin_path(loss_mask_prefix(prefix)),
                                                                dtype=LOSS_MASK_DTYPE))
        self.locations = [LocationsWriter(prefix) for prefix in self.prefixes]
        self.tokens = [0] * len(self.prefixes)
        self.loss_tokens = [0] * len(self.prefixes)

    def __enter__(self) -> "DatasetWriters":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None:
            for builder in self.builders + self.mask_builders:
                builder.abort()
            for locations in self.locations:
                locations.abort()

    def write(self, encoded: Sequence[EncodedKey]) -> None:
        """Append one task's documents to every dataset, one sequence each (and their loss masks)."""
        for key_index, key_documents in enumerate(encoded):
            self.builders[key_index].add_documents(key_documents.tokens, key_documents.lengths,
                                                   key_documents.sequences_per_document)
            self.tokens[key_index] += len(key_documents.tokens)
            if self.mask_builders:
                self.mask_builders[key_index].add_documents(key_documents.loss_mask, key_documents.lengths)
                self.loss_tokens[key_index] += int(key_documents.loss_mask.sum(dtype=np.int64))
            self.locations[key_index].add(key_documents.locations)

    def finalize(self) -> None:
        """Write every index and move the files into place: a dataset's old index first, then its loss mask (or,
        without one, an old mask removed), then its ids; so a dataset that reads back whole never pairs new ids
        with an old mask or none."""
        for key_index, (builder, prefix) in enumerate(zip(self.builders, self.prefixes, strict=True)):
            if os.path.exists(idx_path(prefix)):
                os.remove(idx_path(prefix))
            remove_locations(prefix)
            if self.mask_builders:
                self.mask_builders[key_index].finalize(idx_path(loss_mask_prefix(prefix)))
            else:
                remove_dataset_files(loss_mask_prefix(prefix))
            builder.finalize(idx_path(prefix))
            self.locations[key_index].finalize(prefix)


@dataclass
class PreprocessSummary:
    """What a run did: documents and tokens written, inputs skipped and why."""

    documents: int = 0
    tokens: dict[str, int] = field(default_factory=dict)  # per output prefix
    problems: InputProblems = field(default_factory=InputProblems)
    seconds: float = 0.0
    dtype: str = ""
    loss_tokens: dict[str, int] = field(default_factory=dict)  # per output prefix, for datasets with a loss mask
    skipped_path: str | None = None  # where every skipped record is listed (--skip-invalid)

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())

    def merge(self, other: "PreprocessSummary") -> None:
        """Add another summary's counts."""
        self.documents += other.documents
        for prefix, count in other.tokens.items():
            self.tokens[prefix] = self.tokens.get(prefix, 0) + count
        for prefix, count in other.loss_tokens.items():
            self.loss_tokens[prefix] = self.loss_tokens.get(prefix, 0) + count
        self.problems.merge(other.problems)
        self.dtype = self.dtype or other.dtype

    def format(self) -> str:
        """A few lines for the end of a run."""
        seconds = max(self.seconds, 1e-9)
        lines = [
            f"{self.documents:,} documents, {self.total_tokens:,} tokens in {self.seconds:.1f} s "
            f"({self.documents / seconds:,.1f} docs/s, {self.total_tokens / seconds:,.0f} tokens/s)",
            f"skipped: {self.problems.total:,}",
        ]
        for reason, entry in self.problems.counts.items():
            detail = f": {entry.first_detail}" if entry.first_detail else ""
            lines.append(f"  {reason}: {entry.count:,} (first at {entry.first_location}{detail})")
        if self.skipped_path is not None:
            lines.append(f"  every skipped record's location: {self.skipped_path}")
        for prefix, count in self.tokens.items():
            lines.append(f"wrote {prefix}.bin/.idx ({count:,} {self.dtype} tokens)")
            if prefix in self.loss_tokens:
                share = 100 * self.loss_tokens[prefix] / max(count, 1)
                lines.append(f"wrote {loss_mask_prefix(prefix)}.bin/.idx ({self.loss_tokens[prefix]:,} tokens trained "
                             f"on, {share:.1f}%)")
        return "\n".join(lines)


def encode_config(options: PreprocessOptions, tokenizer: Tokenizer) -> EncodeConfig:
    """Check the tokenizer has the specials asked for, and pick the token dtype."""
    # reading the ids raises a clear error, before any work, when the tokenizer lacks them
    _ = (tokenizer.eod if options.append_eod else None, tokenizer.bos if options.prepend_bos else None)
    dtype = np.dtype(optimal_dtype(tokenizer.vocab_size)).name
    return EncodeConfig(options.tokenizer, dtype, options.append_eod, options.prepend_bos,
                        options.split_sentences, options.keep_newlines, options.lang, options.chat)


def no_documents_error(options: PreprocessOptions, files: Sequence[str], problems: InputProblems) -> NoDocumentsError:
    """Why nothing was written, and that an existing dataset is left as it was."""
    keys = " ".join(options.json_keys)
    prefix = dataset_prefixes(options)[0]
    skipped = ", ".join(f"{entry.count} {reason}" for reason, entry in problems.counts.items()) or "none"
    return NoDocumentsError(
        f"no document with text under --json-keys {keys} in {len(files)} input file(s) (skipped: {skipped}); "
        f"nothing written ({prefix}.bin/.idx left as they were)"
    )


def run_partition(
    files: Sequence[str],
    prefixes: Sequence[str],
    options: PreprocessOptions,
    workers: int,
    position: int = 0,
    require_documents: bool = True,
    skipped_path: str | None = None,
) -> PreprocessSummary:
    """Tokenize `files` into one dataset per key at `prefixes` (with their loss masks for chat data), listing
    every skipped record at `skipped_path` when given; with `require_documents`, inputs without any document
    raise and leave `prefixes` untouched."""
    tokenizer = cached_tokenizer(options.tokenizer)
    config = encode_config(options, tokenizer)
    bytes_read = BytesRead()
    read_options = ReadOptions(tuple(options.json_keys), options.split, document_limit(options, tokenizer),
                               bytes_read, options.chat)
    label = f"partition {position}: " if options.partitions > 1 else ""
    total_bytes = sum(_input_size(path) for path in files)
    with (
        SkippedLog(skipped_path) as skipped,
        DatasetWriters(prefixes, np.dtype(config.dtype).type, options.masked) as writers,
        Progress(options.show_progress, options.log_interval, position, label, total_bytes,
                 lambda: bytes_read.total) as progress,
        TokenizerPool(config, workers) as pool,
    ):
        problems = InputProblems(options.skip_invalid, log=skipped.stream)
        tasks = group_documents(read_documents(files, read_options, problems), options.json_keys)
        for encoded in pool.map_ordered(tasks):
            for location, reason, detail in encoded[0].rejected:  # in a worker: the chat template refused it
                problems.invalid(location, reason, detail)
            writers.write(encoded)
            progress.add(encoded[0].documents, sum(len(key.tokens) for key in encoded))
        if require_documents and progress.documents == 0:
            raise no_documents_error(options, files, problems)  # the writers drop their temporary files
        writers.finalize()
        skipped.finalize(files)
    problems.log = None  # closed; the summary travels back from a partition's process
    tokens = dict(zip(prefixes, writers.tokens, strict=True))
    loss_tokens = dict(zip(prefixes, writers.loss_tokens, strict=True)) if options.masked else {}
    return PreprocessSummary(progress.documents, tokens, problems, progress.elapsed, config.dtype, loss_tokens,
                             skipped_path)


def document_limit(options: PreprocessOptions, tokenizer: Tokenizer) -> int | None:
    """--max-document-chars where documents are encoded whole (a conversation always is: its template renders it
    whole, and its prefixes besides); None where the tokenizer cuts them (its memory is a piece's, whatever the
    document's length)."""
    if tokenizer.cuts_long_documents and not options.split_sentences and options.chat is None:
        return None
    return options.max_document_chars


def split_contiguous(files: Sequence[str], parts: int) -> list[list[str]]:
    """`files` in at most `parts` consecutive groups of similar total size (order kept)."""
    sizes = [_input_size(path) for path in files]
    target = max(sum(sizes), 1) / parts
    groups: list[list[str]] = [[]]
    filled = 0
    for index, (path, size) in enumerate(zip(files, sizes, strict=True)):
        behind = filled >= target * len(groups)  # this group has its share already
        must_spread = len(files) - index <= parts - len(groups)  # one file per remaining group
        if groups[-1] and len(groups) < parts and (behind or must_spread):
            groups.append([])
        groups[-1].append(path)
        filled += size
    return groups


def _input_size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


@dataclass(frozen=True)
class PartitionPlan:
    """One partition of a `--partitions` run: its files, where it writes, and what must have made it."""

    index: int
    count: int
    files: tuple[str, ...]
    prefixes: tuple[str, ...]
    manifest: str
    producer: dict
    masked: bool = False  # loss masks beside the ids
    skipped: str | None = None  # its list of skipped records (--skip-invalid)

    @property
    def outputs(self) -> list[str]:
        datasets = [*self.prefixes, *(map(loss_mask_prefix, self.prefixes) if self.masked else ())]
        listed = [self.skipped] if self.skipped is not None else []
        return [path for prefix in datasets for path in (bin_path(prefix), idx_path(prefix))] + listed

    @property
    def label(self) -> str:
        return f"partition {self.index + 1} of {self.count}"


def partition_work_dir(options: PreprocessOptions) -> str:
    """Where a `--partitions` run keeps its finished partitions until the merge: next to the output, named by
    the output prefix, so a rerun of the same command finds them."""
    prefix = os.path.abspath(options.output_prefix)
    return os.path.join(os.path.dirname(prefix), f".{os.path.basename(prefix)}.partitions")


def tokenizer_identity(options: PreprocessOptions) -> dict:
    """The tokenizer by type and by the digest of its files (a retrained model at the same path differs)."""
    spec = options.tokenizer
    return {"type": spec.type, "vocab_size": spec.vocab_size,
            "files": {flag: path_digest(path) for flag, path in spec.files().items()}}


def partition_producer(options: PreprocessOptions, files: Sequence[str], dtype: str, tokenizer: dict) -> dict:
    """Everything a partition's bytes depend on, named by flag (`tokenizer`: its `tokenizer_identity`):
    reused only when all of it is the same."""
    return {
        "tokenizer (--tokenizer-type, its files' SHA-256, --vocab-size)": tokenizer,
        "--json-keys": list(options.json_keys),
        "--append-eod": options.append_eod,
        "--prepend-bos": options.prepend_bos,
        "--split": options.split,
        "--skip-invalid": options.skip_invalid,
        "--max-document-chars (where documents are encoded whole)": document_limit(
            options, cached_tokenizer(options.tokenizer)),
        "--split-sentences/--keep-newlines/--lang": [options.split_sentences, options.keep_newlines,
                                                     options.lang if options.split_sentences else None],
        "token dtype": dtype,
        "input files (path, size, modification time)": input_identity(files),
        "--chat-template (its file's SHA-256)/--loss-on/--chat-documents/--train-key/--chat-template-kwargs-keys":
            chat_identity(options.chat),
    }


def chat_identity(chat: ChatSettings | None) -> list | None:
    """The chat settings a partition was made with: the template by value and digest, and `--loss-on` (the
    tokenizer's own template is in its files' digest)."""
    if chat is None:
        return None
    digest = path_digest(chat.template_file) if chat.template_file is not None else None
    return [chat.template, digest, chat.loss_on, chat.documents, chat.train_key, list(chat.template_kwargs_keys)]


def plan_partitions(files: list[str], options: PreprocessOptions, work_dir: str) -> list[PartitionPlan]:
    """The partitions of `files` (consecutive groups of similar size) and what each must be made by."""
    groups = split_contiguous(files, options.partitions)
    dtype = encode_config(options, cached_tokenizer(options.tokenizer)).dtype
    tokenizer = tokenizer_identity(options)  # hashed once, not per partition
    return [
        PartitionPlan(i, len(groups), tuple(group),
                      tuple(os.path.join(work_dir, f"{i}_{key}") for key in options.dataset_keys),
                      os.path.join(work_dir, f"{i}.manifest.json"),
                      partition_producer(options, group, dtype, tokenizer), options.masked,
                      os.path.join(work_dir, f"{i}_skipped.tsv") if options.skip_invalid else None)
        for i, group in enumerate(groups)
    ]


def summary_record(summary: PreprocessSummary, keys: Sequence[str]) -> dict:
    """A partition's summary as JSON for its manifest (tokens by key)."""
    problems = {reason: [entry.count, entry.first_location, entry.first_detail]
                for reason, entry in summary.problems.counts.items()}
    return {"documents": summary.documents, "tokens": dict(zip(keys, summary.tokens.values(), strict=True)),
            "loss_tokens": dict(zip(keys, summary.loss_tokens.values())),
            "problems": problems, "seconds": summary.seconds, "dtype": summary.dtype}


def summary_from_record(record: dict, plan: PartitionPlan, keys: Sequence[str]) -> PreprocessSummary:
    """The summary a manifest recorded, keyed by the partition's prefixes as a fresh run's would be."""
    problems = InputProblems()
    for reason, (count, location, detail) in record["problems"].items():
        problems.counts[reason] = ProblemCount(count, location, detail)
    tokens = {prefix: record["tokens"][key] for prefix, key in zip(plan.prefixes, keys, strict=True)}
    loss_tokens = {prefix: record["loss_tokens"][key] for prefix, key in zip(plan.prefixes, keys)
                   if key in record["loss_tokens"]}
    return PreprocessSummary(record["documents"], tokens, problems, record["seconds"], record["dtype"], loss_tokens)


def build_partition(plan: PartitionPlan, options: PreprocessOptions, workers: int) -> PreprocessSummary:
    """Tokenize one partition, then record it in its manifest (last: a partition without one is unfinished)."""
    summary = run_partition(plan.files, plan.prefixes, options, workers, plan.index, require_documents=False,
                            skipped_path=plan.skipped)
    write_manifest(plan.manifest, plan.producer, plan.outputs, summary_record(summary, options.dataset_keys))
    return summary


def reusable_partition(plan: PartitionPlan, keys: Sequence[str]) -> tuple[PreprocessSummary | None, str]:
    """A finished, verified partition's summary; else None and why it is redone."""
    record, reason = verified_summary(plan.manifest, plan.producer, plan.outputs)
    if record is None:
        return None, reason
    try:
        return summary_from_record(record, plan, keys), ""
    except (KeyError, TypeError, ValueError):
        return None, "its manifest's summary is unreadable"


def _run_partitions(files: list[str], options: PreprocessOptions) -> PreprocessSummary:
    """Each group of files in its own process, then the parts merged in input order. Finished partitions
    stay in the work directory until the merge is done: a rerun of a killed run redoes only the others."""
    final_prefixes = dataset_prefixes(options)
    work_dir = partition_work_dir(options)
    resuming = os.path.isdir(work_dir)
    os.makedirs(work_dir, exist_ok=True)
    plans = plan_partitions(files, options, work_dir)
    parts: dict[int, PreprocessSummary] = {}
    todo = []
    for plan in plans:
        summary, reason = reusable_partition(plan, options.dataset_keys) if resuming else (None, "")
        if summary is not None:
            parts[plan.index] = summary
        else:
            todo.append(plan)
        if resuming:
            what = "reused: its manifest matches these flags and inputs, and its files their sizes and SHA-256" \
                if summary is not None else f"redone: {reason}"
            print(f"preprocess_data: {work_dir}: {plan.label}: {what}", file=sys.stderr, flush=True)
    try:
        parts.update(_build_partitions(todo, options))
    except BaseException:
        _keep_or_remove(work_dir, plans)
        raise
    summary = _combine([parts[plan.index] for plan in plans], final_prefixes)
    if summary.documents == 0:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise no_documents_error(options, files, summary.problems)
    for key_index, final in enumerate(final_prefixes):
        merge_with_loss_masks([plan.prefixes[key_index] for plan in plans], final)
    if options.skipped_path is not None:
        concatenate_skipped_logs([plan.skipped for plan in plans], options.skipped_path)
        summary.skipped_path = options.skipped_path
    shutil.rmtree(work_dir, ignore_errors=True)
    return summary


def _build_partitions(plans: Sequence[PartitionPlan], options: PreprocessOptions) -> dict[int, PreprocessSummary]:
    """Build `plans` in parallel, one process each (every one finishes even when another fails)."""
    if not plans:
        return {}
    workers_each = max(1, options.workers // len(plans))
    with ProcessPoolExecutor(len(plans), mp_context=multiprocessing.get_context()) as executor:
        futures = {plan.index: executor.submit(build_partition, plan, options, workers_each) for plan in plans}
        return {index: future.result() for index, future in futures.items()}


def _keep_or_remove(work_dir: str, plans: Sequence[PartitionPlan]) -> None:
    """After a failed run: keep the finished partitions for a rerun (saying so), or remove an empty work dir."""
    finished = [plan.label for plan in plans if os.path.isfile(plan.manifest)]
    if not finished:
        shutil.rmtree(work_dir, ignore_errors=True)
        return
    print(f"preprocess_data: {work_dir}: kept {len(finished)} finished partition(s) of {len(plans)}: the same "
          "command again redoes only the others", file=sys.stderr, flush=True)


def _combine(parts: Sequence[PreprocessSummary], final_prefixes: Sequence[str]) -> PreprocessSummary:
    """One summary for the merged output: counts added, tokens keyed by final prefix."""
    summary = PreprocessSummary(dtype=parts[0].dtype)
    for part in parts:
        renamed = dict(zip(final_prefixes, part.tokens.values(), strict=True))
        loss_tokens = dict(zip(final_prefixes, part.loss_tokens.values())) if part.loss_tokens else {}
        summary.merge(PreprocessSummary(part.documents, renamed, part.problems, part.seconds, part.dtype,
                                        loss_tokens))
    return summary


def preprocess(options: PreprocessOptions) -> PreprocessSummary:
    """Tokenize `options.inputs` into `PREFIX_{key}_document.{bin,idx}` for each JSON key."""
    if options.workers < 1 or options.partitions < 1:
        raise ValueError(f"--workers ({options.workers}) and --partitions ({options.partitions}) must be >= 1")
    start = time.perf_counter()
    files = input_files(options)
    if options.partitions > 1 and len(files) > 1:
        summary = _run_partitions(files, options)
    else:
        prefixes = dataset_prefixes(options)
        summary = run_partition(files, prefixes, options, options.workers, skipped_path=options.skipped_path)
    stale = skipped_log_path(options.output_prefix)
    if options.skipped_path is None and os.path.exists(stale):  # an earlier run's list would name other skips
        os.remove(stale)
    summary.seconds = time.perf_counter() - start
    return summary


def output_files(options: PreprocessOptions) -> set[str]:
    """The absolute paths this run writes (an old loss mask it would remove included)."""
    prefixes = dataset_prefixes(options)
    prefixes += [loss_mask_prefix(prefix) for prefix in prefixes]
    listed = {os.path.abspath(skipped_log_path(options.output_prefix))}
    listed |= {os.path.abspath(locations_path(prefix)) for prefix in dataset_prefixes(options)}
    return {os.path.abspath(path) for prefix in prefixes for path in (bin_path(prefix), idx_path(prefix))} | listed


def input_files(options: PreprocessOptions, announce: bool = True) -> list[str]:
    """The input files, without this run's own output: an input directory that also holds the previous
    output would otherwise read its .bin/.idx as plain-text documents."""
    outputs = output_files(options)
    files = expand_inputs(options.inputs)
    kept = [path for path in files if os.path.abspath(path) not in outputs]
    for path in sorted(set(files) - set(kept)) if announce else ():
        print(f"preprocess_data: not reading {path}: it is this run's output (--output-prefix)", file=sys.stderr)
    return kept
