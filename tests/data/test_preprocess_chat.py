"""preprocess with --chat-template: conversations in, Megatron's ids and a loss mask out; every bad input named by
file:line (or skipped, counted and listed); workers and partitions write the same bytes; nothing half-written."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megatron_lc.data.chat import ChatSettings
from megatron_lc.data.corpus import InvalidInputError
from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.loss_mask import has_loss_mask, loss_mask_prefix
from megatron_lc.data.preprocess import (
    PreprocessOptions,
    _build_partitions,
    partition_work_dir,
    plan_partitions,
    preprocess,
)
from megatron_lc.data.preprocess_cli import main
from tests.data.helpers import reference_chat_ids

TURNS = ["the long context of a book", "holds many tokens", "and every token counts", "naïve café 数据 🙂",
         "in training", "12345 tokens"]


def conversation(index: int) -> list[dict]:
    """A conversation of 1 to 3 exchanges, some with a system message."""
    messages = [{"role": "system", "content": f"system {index}"}] if index % 3 == 0 else []
    for turn in range(1 + index % 3):
        messages += [{"role": "user", "content": f"{TURNS[(index + turn) % 6]} {index}"},
                     {"role": "assistant", "content": f"{TURNS[(index + turn + 1) % 6]} {turn}"}]
    return messages


CONVERSATIONS = [conversation(i) for i in range(30)]


@pytest.fixture
def prefix(tmp_path):
    return str(tmp_path / "out" / "chat")


@pytest.fixture
def chat_run(chat_tokenizer_dir, prefix):
    def run(inputs, keys=("messages",), loss_on="assistant", template="hf", **overrides):
        settings = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=chat_tokenizer_dir, show_progress=False,
                        json_keys=tuple(keys), chat=ChatSettings(template, loss_on))
        settings.update(overrides)
        return preprocess(PreprocessOptions(inputs=tuple(map(str, inputs)), output_prefix=prefix, **settings))

    return run


def read(prefix: str, key: str = "messages") -> tuple[list[list[int]], list[list[int]] | None]:
    ids = IndexedDataset(f"{prefix}_{key}_document")
    documents = [ids[i].tolist() for i in range(len(ids))]
    if not has_loss_mask(f"{prefix}_{key}_document"):
        return documents, None
    mask = IndexedDataset(loss_mask_prefix(f"{prefix}_{key}_document"))
    assert np.array_equal(mask.document_indices, ids.document_indices)
    return documents, [mask[i].tolist() for i in range(len(mask))]


def output_files(prefix: str, key: str = "messages") -> dict[str, bytes]:
    base = f"{prefix}_{key}_document"
    paths = [base + ".bin", base + ".idx", base + "_loss_mask.bin", base + "_loss_mask.idx", prefix + "_skipped.tsv"]
    return {os.path.basename(p): open(p, "rb").read() for p in paths if os.path.exists(p)}


def test_ids_are_apply_chat_template_and_the_mask_marks_assistant_turns(chat_run, write_jsonl, prefix, chat_hf_tokenizer):
    summary = chat_run([write_jsonl("chat.jsonl", [{"messages": m, "id": i} for i, m in enumerate(CONVERSATIONS)])])
    documents, masks = read(prefix)
    assert documents == [reference_chat_ids(chat_hf_tokenizer, m) for m in CONVERSATIONS]
    for ids, mask, messages in zip(documents, masks, CONVERSATIONS):
        trained = chat_hf_tokenizer.decode([t for t, k in zip(ids, mask) if k])
        assert trained == "".join(m["content"] + "<|eot_id|>" for m in messages if m["role"] == "assistant")
    assert summary.documents == 30 and summary.loss_tokens == {f"{prefix}_messages_document": sum(map(sum, masks))}


def test_megatron_core_reads_the_ids_and_the_mask_unchanged(chat_run, write_jsonl, prefix,
                                                            megatron_indexed_dataset):
    chat_run([write_jsonl("chat.jsonl", [{"messages": m} for m in CONVERSATIONS])])
    documents, masks = read(prefix)
    for base, expected in ((f"{prefix}_messages_document", documents),
                           (f"{prefix}_messages_document_loss_mask", masks)):
        theirs = megatron_indexed_dataset.IndexedDataset(base)
        assert [theirs[i].tolist() for i in range(len(theirs))] == expected
        assert theirs.document_indices.tolist() == list(range(len(CONVERSATIONS) + 1))


def test_sharegpt_and_prompt_completion_records_are_read(chat_run, write_jsonl, prefix, chat_hf_tokenizer):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in c]}
                for c in CONVERSATIONS[:5]]
    chat_run([write_jsonl("sharegpt.jsonl", sharegpt)], keys=("conversations",))
    assert read(prefix, "conversations")[0] == [reference_chat_ids(chat_hf_tokenizer, m) for m in CONVERSATIONS[:5]]
    records = [{"prompt": TURNS[i], "completion": TURNS[i + 1]} for i in range(5)]
    chat_run([write_jsonl("pc.jsonl", records)], keys=("prompt", "completion"))
    documents, masks = read(prefix, "prompt_completion")
    for record, ids, mask in zip(records, documents, masks):
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
        assert ids == reference_chat_ids(chat_hf_tokenizer, messages)
        assert chat_hf_tokenizer.decode([t for t, k in zip(ids, mask) if k]) == record["completion"] + "<|eot_id|>"


def test_loss_on_all_writes_no_mask_and_removes_an_old_one(chat_run, write_jsonl, prefix):
    path = write_jsonl("chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    chat_run([path])
    documents, _ = read(prefix)
    chat_run([path], loss_on="all")
    assert read(prefix) == (documents, None)


def strict_template(directory) -> str:
    """A template file that refuses (raise_exception) a conversation opening with the assistant."""
    template = directory / "strict.jinja"
    template.write_text("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('user first') }}{% endif %}"
                        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}"
                        "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
                        "<|end_header_id|>{% endif %}")
    return str(template)


BAD_LINES = [
    ('{"messages": "hello"}', "conversation not a list"),
    ('{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}', "unknown role"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]}', "missing content"),
    ('{"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "y"}]}', "non-string content"),
    ('{"messages": []}', "empty conversation"),
    ('{"messages": [{"role": "user", "content": "only a question"}]}', "no assistant turn"),
    ('{"messages": [{"role": "user", "content": "x"}, ', "malformed JSON"),
    ('{"text": "not a conversation"}', "missing key 'messages'"),
    ('{"messages": [{"role": "assistant", "content": "first"}]}', "refused by the chat template"),
]


@pytest.mark.parametrize("line, reason", BAD_LINES)
def test_each_bad_conversation_stops_the_run_with_file_and_line(chat_run, write_jsonl, prefix, line, reason, tmp_path):
    kwargs = {"template": strict_template(tmp_path)} if reason == "refused by the chat template" else {}
    good = json.dumps({"messages": CONVERSATIONS[0]})
    path = write_jsonl("chat.jsonl", [good, good, line, good])
    with pytest.raises(InvalidInputError) as error:
        chat_run([path], **kwargs)
    message = str(error.value)
    assert message.startswith(f"{path}:3: {reason}") and message.count("\n") == 0
    assert not os.path.exists(os.path.dirname(prefix)) or not os.listdir(os.path.dirname(prefix))


def test_skip_invalid_counts_each_category_and_lists_every_skipped_line(chat_run, write_jsonl, prefix, chat_hf_tokenizer):
    good = [json.dumps({"messages": m}) for m in CONVERSATIONS[:3]]
    lines = [good[0], BAD_LINES[1][0], good[1], BAD_LINES[5][0], BAD_LINES[1][0], BAD_LINES[6][0], good[2],
             BAD_LINES[0][0]]
    path = write_jsonl("chat.jsonl", lines)
    summary = chat_run([path], skip_invalid=True)
    assert read(prefix)[0] == [reference_chat_ids(chat_hf_tokenizer, m) for m in CONVERSATIONS[:3]]
    counts = {reason: entry.count for reason, entry in summary.problems.counts.items()}
    assert counts == {"unknown role": 2, "no assistant turn": 1, "malformed JSON": 1, "conversation not a list": 1}
    listed = [line.split("\t") for line in open(f"{prefix}_skipped.tsv", encoding="utf-8").read().splitlines()]
    assert [(row[0], row[1]) for row in listed] == [
        (f"{path}:2", "unknown role"), (f"{path}:4", "no assistant turn"), (f"{path}:5", "unknown role"),
        (f"{path}:6", "malformed JSON"), (f"{path}:8", "conversation not a list")]
    assert f"every skipped record's location: {prefix}_skipped.tsv" in summary.format()
    chat_run([write_jsonl("good.jsonl", good)])  # without --skip-invalid: the earlier list is removed
    assert not os.path.exists(f"{prefix}_skipped.tsv")


def test_a_record_whose_turns_cannot_be_located_is_one_line_and_skipped_with_skip_invalid(chat_run, write_jsonl,
                                                                                         prefix, tmp_path):
    template = tmp_path / "last.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}<|eot_id|>"
                        "{% endfor %}")
    alone = [{"role": "assistant", "content": "alone"}]  # nothing before it: its span is the whole rendering
    path = write_jsonl("chat.jsonl", [{"messages": m} for m in CONVERSATIONS[:3] + [alone]])
    with pytest.raises(InvalidInputError, match=f"^{path}:1: turn not located in the rendering: messages\\[2\\] is "
                       "trained, but the template renders messages\\[:2\\] with the generation prompt as text that "
                       "parts from the whole conversation's"):
        chat_run([path], template=str(template))
    assert not os.listdir(os.path.dirname(prefix))
    summary = chat_run([path], template=str(template), skip_invalid=True)
    documents, masks = read(prefix)
    assert len(documents) == 1 and all(masks[0])
    assert summary.problems.counts["turn not located in the rendering"].count == 3
    assert [line.split("\t")[0] for line in open(f"{prefix}_skipped.tsv")] == [f"{path}:{n}" for n in (1, 2, 3)]


def test_two_workers_and_partitions_write_the_same_bytes_as_one_pass(chat_run, write_jsonl, prefix):
    lines = [json.dumps({"messages": m}) for m in CONVERSATIONS] + [BAD_LINES[0][0]]
    paths = [write_jsonl(f"part{i}.jsonl", lines[i::3]) for i in range(3)]
    chat_run(paths, skip_invalid=True)
    expected = output_files(prefix)
    assert len(expected) == 5
    chat_run(paths, skip_invalid=True, workers=2)
    assert output_files(prefix) == expected
    chat_run(paths, skip_invalid=True, partitions=3)
    assert output_files(prefix) == expected


def test_a_partition_whose_mask_was_damaged_is_redone(chat_run, chat_tokenizer_dir, write_jsonl, prefix, capsys):
    paths = [write_jsonl(f"part{i}.jsonl", [{"messages": m} for m in CONVERSATIONS[i::2]]) for i in range(2)]
    chat_run(paths)
    expected = output_files(prefix)
    options = PreprocessOptions(inputs=tuple(map(str, paths)), output_prefix=prefix,
                                tokenizer_type="HuggingFaceTokenizer", tokenizer_model=chat_tokenizer_dir,
                                show_progress=False, json_keys=("messages",), chat=ChatSettings("hf"), partitions=2)
    work_dir = partition_work_dir(options)
    os.makedirs(work_dir)
    plans = plan_partitions(list(map(str, paths)), options, work_dir)
    _build_partitions(plans, options)  # as a run killed before its merge leaves them
    mask_bin = f"{plans[1].prefixes[0]}_loss_mask.bin"
    data = bytearray(open(mask_bin, "rb").read())
    data[0] ^= 1
    open(mask_bin, "wb").write(bytes(data))
    preprocess(options)
    err = capsys.readouterr().err
    assert "partition 1 of 2: reused" in err and "partition 2 of 2: redone: " in err and "_loss_mask.bin" in err
    assert output_files(prefix) == expected


def test_plain_text_writes_no_mask_and_removes_an_old_one(chat_run, write_jsonl, prefix):
    chat_run([write_jsonl("chat2.jsonl", [{"text": m} for m in CONVERSATIONS[:3]])], keys=("text",))
    assert has_loss_mask(f"{prefix}_text_document")
    preprocess(PreprocessOptions(inputs=(str(write_jsonl("plain.jsonl", [{"text": "plain"}])),), output_prefix=prefix,
                                 tokenizer_type="ByteTokenizer", show_progress=False))
    assert read(prefix, "text") == ([list(b"plain")], None)


def test_a_conversation_without_chat_template_says_which_flag_reads_it(write_jsonl, tmp_path, capsys):
    path = write_jsonl("chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    assert main(["--input", str(path), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "ByteTokenizer",
                 "--json-keys", "messages", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"preprocess_data: error: {path}:1: non-string value for 'messages': list (a conversation? give "
                   "--chat-template hf or FILE.jinja) (--skip-invalid skips such input)")


@pytest.mark.parametrize("flags, message", [
    (["--loss-on", "all"], "--loss-on all needs --chat-template"),
    (["--chat-documents", "turn"], "--chat-documents turn needs --chat-template"),
    (["--train-key", "train"], "--train-key train needs --chat-template"),
    (["--chat-template-kwargs-keys", "tools"], "--chat-template-kwargs-keys tools needs --chat-template"),
    (["--chat-template", "hf", "--loss-on", "all", "--chat-documents", "turn"],
     "--chat-documents turn with --loss-on all: every token is trained"),
    (["--chat-template", "hf", "--loss-on", "all", "--train-key", "train"], "--train-key train with --loss-on all"),
    (["--chat-template", "hf", "--append-eod"], "--append-eod with --chat-template hf: a document's ids are exactly"),
    (["--chat-template", "hf", "--prepend-bos"], "--prepend-bos with --chat-template hf"),
    (["--chat-template", "hf", "--json-keys", "a", "b", "c"], "--chat-template hf: --json-keys names one conversation"),
    (["--chat-template", "missing.jinja"], "--chat-template missing.jinja: no such file"),
    (["--chat-template", "BAD"], "--chat-template {bad}:1: "),
    (["--chat-template", "hf", "--tokenizer-type", "ByteTokenizer"],
     "--chat-template hf needs --tokenizer-type HuggingFaceTokenizer"),
    (["--chat-template", "hf", "--tokenizer-model", "NOTEMPLATE"], "--chat-template hf: the tokenizer at"),
])
def test_flags_that_cannot_work_are_refused_in_one_line_before_reading(chat_tokenizer_dir, write_jsonl, tmp_path,
                                                                       capsys, flags, message):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m }")
    plain = tmp_path / "plain_tokenizer"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((open(os.path.join(chat_tokenizer_dir, "tokenizer.json"), "rb").read()))
    flags = [{"BAD": str(bad), "NOTEMPLATE": str(plain)}.get(flag, flag) for flag in flags]
    message = message.format(bad=bad)
    path = write_jsonl("chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    argv = ["--input", str(path), "--output-prefix", str(tmp_path / "o"), "--json-keys", "messages",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", chat_tokenizer_dir, *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err
    assert not [name for name in os.listdir(tmp_path) if name.startswith("o")]


def test_parquet_and_json_array_conversations_give_the_json_lines_bytes(chat_run, write_jsonl, prefix, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"messages": m} for m in CONVERSATIONS[:8]]
    chat_run([write_jsonl("chat.jsonl", records)])
    expected = output_files(prefix)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chat.parquet")
    chat_run([tmp_path / "chat.parquet"])
    assert output_files(prefix) == expected
    (tmp_path / "chat.json").write_text(json.dumps(records, indent=1))
    chat_run([tmp_path / "chat.json"])
    assert output_files(prefix) == expected


def test_the_command_line_writes_ids_and_mask_and_says_how_many_tokens_are_trained(
        chat_tokenizer_dir, write_jsonl, tmp_path, capsys):
    path = write_jsonl("chat.jsonl", [{"messages": m} for m in CONVERSATIONS[:4]])
    out = tmp_path / "out" / "c"
    assert main(["--input", str(path), "--output-prefix", str(out), "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", chat_tokenizer_dir, "--json-keys", "messages", "--chat-template", "hf",
                 "--no-progress"]) == 0
    documents, masks = read(str(out))
    trained = sum(map(sum, masks))
    lines = capsys.readouterr().out.splitlines()
    assert f"wrote {out}_messages_document.bin/.idx ({sum(map(len, documents)):,} uint16 tokens)" in lines
    assert any(line.startswith(f"wrote {out}_messages_document_loss_mask.bin/.idx ({trained:,} tokens trained on, ")
               for line in lines)


def test_the_skipped_list_is_in_input_order_whatever_the_workers(chat_run, write_jsonl, prefix, tmp_path):
    """A conversation the template refuses is found when its task is encoded, after the reading has skipped later
    lines: the list is still in input order, and the same for any --workers."""
    good = [json.dumps({"messages": m}) for m in CONVERSATIONS]
    refused = BAD_LINES[-1][0]
    lines = [good[0], refused, good[1], BAD_LINES[0][0], refused, *good[2:], BAD_LINES[6][0], refused]
    path = write_jsonl("chat.jsonl", lines)
    template = strict_template(tmp_path)
    chat_run([path], template=template, skip_invalid=True)
    listed = [line.split("\t")[:2] for line in open(f"{prefix}_skipped.tsv", encoding="utf-8").read().splitlines()]
    n = len(lines)
    assert listed == [[f"{path}:2", "refused by the chat template"], [f"{path}:4", "conversation not a list"],
                      [f"{path}:5", "refused by the chat template"], [f"{path}:{n - 1}", "malformed JSON"],
                      [f"{path}:{n}", "refused by the chat template"]]
    expected = output_files(prefix)
    chat_run([path], template=template, skip_invalid=True, workers=2)
    assert output_files(prefix) == expected


def test_tools_flags_and_turn_documents_from_the_command_line(chat_tokenizer_dir, chat_hf_tokenizer, write_jsonl,
                                                              prefix, capsys):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    flagged = [dict(m, train=False) if i == 1 else m for i, m in enumerate(CONVERSATIONS[2])]
    records = [{"messages": CONVERSATIONS[1], "tools": tools}, {"messages": flagged}]
    path = write_jsonl("chat.jsonl", records)
    base = ["--input", str(path), "--output-prefix", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", chat_tokenizer_dir, "--json-keys", "messages", "--chat-template", "hf",
            "--no-progress"]
    assert main(base) == 1  # the record's tools and flags would be dropped: refused, naming the flag
    assert "--chat-template-kwargs-keys tools" in capsys.readouterr().err
    assert main(base + ["--chat-template-kwargs-keys", "tools", "--train-key", "train", "--chat-documents",
                        "turn"]) == 0
    documents, masks = read(prefix)
    plain = CONVERSATIONS[2]
    expected = [reference_chat_ids(chat_hf_tokenizer, CONVERSATIONS[1][: i + 1], tools=tools)
                for i, m in enumerate(CONVERSATIONS[1]) if m["role"] == "assistant"]
    expected += [reference_chat_ids(chat_hf_tokenizer, plain[: i + 1]) for i in (3, 5)]  # message 1 not trained
    assert documents == expected
    for ids, mask, turn in zip(documents[-2:], masks[-2:], (3, 5)):
        assert chat_hf_tokenizer.decode([t for t, k in zip(ids, mask) if k]) == plain[turn]["content"] + "<|eot_id|>"


def test_max_document_chars_applies_to_conversations_even_with_a_tokenizer_that_cuts_text(chat_run, write_jsonl,
                                                                                          prefix):
    # the byte-level BPE of Llama 3's pattern encodes long plain text in pieces; a conversation is rendered whole
    long = [{"role": "user", "content": "a" * 500}, {"role": "assistant", "content": "b"}]
    path = write_jsonl("chat.jsonl", [{"messages": CONVERSATIONS[0]}, {"messages": long}])
    with pytest.raises(InvalidInputError, match=f"^{path}:2: document over --max-document-chars: 501 characters"):
        chat_run([path], max_document_chars=400)
    summary = chat_run([path], max_document_chars=400, skip_invalid=True)
    assert summary.documents == 1 and summary.problems.counts["document over --max-document-chars"].count == 1
