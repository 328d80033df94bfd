"""Chat data as users have it, under real template shapes (Qwen2.5's ChatML with its default system prompt and tools,
Qwen3's with reasoning, Mistral's [INST]): ids exactly transformers' `apply_chat_template`, masks exactly its
`return_assistant_tokens_mask` where the template marks generation, and every record trained as its author meant
(tools rendered, per-message flags honoured, tool-call and multi-part contents read, history-rewriting templates
trained by --loss-on last or one document per turn)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_lc.data.chat import ChatEncoder
from megatron_lc.data.chat_records import ChatSettings, ConversationError, conversation_from_record
from megatron_lc.data.encode import encode_conversations
from tests.data.chat_templates import (
    LLAMA31_TEMPLATE,
    MISTRAL_TEMPLATE,
    QWEN3_TEMPLATE,
    QWEN25_GENERATION_TEMPLATE,
    QWEN25_TEMPLATE,
    write_chatml_tokenizer,
)
from tests.data.helpers import reference_chat_ids

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TOOL_CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
TOOL_CONVERSATION = [
    {"role": "user", "content": "the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": TOOL_CALL},
    {"role": "tool", "content": "{\"sky\": \"clear\"}"},
    {"role": "assistant", "content": "clear skies in Paris"},
]
PLAIN = [
    [{"role": "user", "content": "the long context of a book"}, {"role": "assistant", "content": "\nholds tokens"}],
    [{"role": "system", "content": "every token counts"}, {"role": "user", "content": "naïve café 数据"},
     {"role": "assistant", "content": "\n\nthe book"}, {"role": "user", "content": "and then?"},
     {"role": "assistant", "content": "many tokens\n"}],
    [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a plain answer"}],
]
REASONING = [
    {"role": "user", "content": "how long is the book?"},
    {"role": "assistant", "content": "<think>\ncount the pages\n</think>\n\nthree hundred pages"},
    {"role": "user", "content": "and its tokens?"},
    {"role": "assistant", "content": "a lot", "reasoning_content": "pages times words"},
]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory, corpus_texts):
    """Qwen2.5's tokenizer shape with its template marked for generation, and transformers' reading of it."""
    from transformers import AutoTokenizer

    directory = write_chatml_tokenizer(tmp_path_factory.mktemp("chatml"), corpus_texts, QWEN25_GENERATION_TEMPLATE)
    return directory, AutoTokenizer.from_pretrained(directory, local_files_only=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, corpus_texts):
    from transformers import AutoTokenizer

    directory = write_chatml_tokenizer(tmp_path_factory.mktemp("qwen3"), corpus_texts, QWEN3_TEMPLATE)
    return directory, AutoTokenizer.from_pretrained(directory, local_files_only=True)


def encoder_for(directory: str, template_file=None, **settings) -> ChatEncoder:
    return ChatEncoder(directory, ChatSettings(str(template_file) if template_file else "hf", **settings))


def read(record: dict, settings: ChatSettings, keys=("messages",)):
    return conversation_from_record(record, keys, settings.loss_on, settings.train_key, settings.template_kwargs_keys)


def trained_text(tokenizer, ids, mask) -> str:
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


def test_chatml_masks_equal_transformers_assistant_masks_where_a_header_and_content_merge(chatml):
    directory, reference = chatml
    encoder = encoder_for(directory)
    for messages in PLAIN:
        expected = reference.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = encoder.ids_and_mask(read({"messages": messages}, encoder.settings))
        assert ids == list(expected["input_ids"]) and mask.tolist() == list(expected["assistant_masks"])
    # the case that needs characters: "assistant\n" + "\nholds" encodes "\n\n" as one token, so the generation
    # prompt's ids are no prefix of the whole's; the merged token is trained (transformers' rule)
    messages = PLAIN[0]
    prompt = reference_chat_ids(reference, messages[:1], add_generation_prompt=True)
    whole = reference_chat_ids(reference, messages)
    assert whole[: len(prompt)] != prompt
    assert reference.decode(whole[len(prompt) - 1]) == "\n\n"
    # the default system prompt is rendered and untrained
    assert reference.decode(whole).startswith("<|im_start|>system\nYou are Qwen")


def test_tools_named_by_the_flag_render_as_apply_chat_template_with_tools(chatml, tmp_path):
    directory, reference = chatml
    template = tmp_path / "qwen25.jinja"
    template.write_text(QWEN25_TEMPLATE)
    settings = dict(template_kwargs_keys=("tools",))
    encoder = encoder_for(directory, template, **settings)
    ids, mask = encoder.ids_and_mask(read({"messages": TOOL_CONVERSATION, "tools": TOOLS}, encoder.settings))
    expected = reference_chat_ids(reference, TOOL_CONVERSATION, tools=TOOLS, chat_template=QWEN25_TEMPLATE)
    assert ids == expected
    assert len(ids) > len(reference_chat_ids(reference, TOOL_CONVERSATION, chat_template=QWEN25_TEMPLATE)) + 50
    assert "get_weather" in reference.decode(ids[: int(np.flatnonzero(mask)[0])])  # described in the system turn
    assert trained_text(reference, ids, mask) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "clear skies in Paris<|im_end|>\n")
    # tools in JSON text (a column of one type) are the same tools
    as_text = encoder.ids_and_mask(read({"messages": TOOL_CONVERSATION, "tools": __import__("json").dumps(TOOLS)},
                                        encoder.settings))
    assert as_text[0] == ids
    # without the flag, a record's tools are refused, never dropped
    with pytest.raises(ConversationError, match="'tools' not passed to the template.*--chat-template-kwargs-keys "
                       "tools"):
        read({"messages": TOOL_CONVERSATION, "tools": TOOLS}, ChatSettings("hf"))
    for empty in ([], "[]", None):  # nothing to describe: read as a record without tools
        assert read({"messages": PLAIN[0], "tools": empty}, ChatSettings("hf")).template_kwargs == {}


def test_content_shapes_tool_call_null_text_parts_and_sharegpt_function_roles(chatml):
    directory, reference = chatml
    encoder = encoder_for(directory)
    parts = [{"role": "user", "content": [{"type": "text", "text": "the long"}, {"type": "text", "text": "context"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "holds tokens"}]}]
    joined = [{"role": "user", "content": "the long context"}, {"role": "assistant", "content": "holds tokens"}]
    ids, mask = encoder.ids_and_mask(read({"messages": parts}, encoder.settings))
    assert ids == reference_chat_ids(reference, joined)
    sharegpt = [{"from": "human", "value": "the weather?"}, {"from": "function_call", "value": "get_weather()"},
                {"from": "observation", "value": "clear"}, {"from": "gpt", "value": "clear skies"}]
    conversation = read({"conversations": sharegpt}, encoder.settings, ("conversations",))
    assert [m["role"] for m in conversation.messages] == ["user", "assistant", "tool", "assistant"]
    openai = [{"role": r, "content": m["value"]} for r, m in zip(["user", "assistant", "tool", "assistant"], sharegpt)]
    ids, mask = encoder.ids_and_mask(conversation)
    assert ids == reference_chat_ids(reference, openai)
    assert trained_text(reference, ids, mask) == "get_weather()<|im_end|>\nclear skies<|im_end|>\n"
    # an OpenAI tool call with content null is read (transformers drops the null), and trained
    tools_encoder = encoder_for(directory, template_kwargs_keys=("tools",))
    ids, mask = tools_encoder.ids_and_mask(read({"messages": TOOL_CONVERSATION}, tools_encoder.settings))
    assert ids == reference_chat_ids(reference, TOOL_CONVERSATION)
    assert "get_weather" in trained_text(reference, ids, mask)


def test_train_key_flags_each_message_and_unread_flags_are_refused(chatml):
    directory, reference = chatml
    messages = [{"role": "user", "content": "first"},
                {"role": "assistant", "content": "not this one", "train": False},
                {"role": "user", "content": "second", "train": True}, {"role": "assistant", "content": "this one"}]
    encoder = encoder_for(directory, train_key="train")
    ids, mask = encoder.ids_and_mask(read({"messages": messages}, encoder.settings))
    plain = [{k: v for k, v in m.items() if k != "train"} for m in messages]
    assert ids == reference_chat_ids(reference, plain)
    assert trained_text(reference, ids, mask) == "<|im_start|>user\nsecond<|im_end|>\nthis one<|im_end|>\n"
    for key in ("train", "weight", "loss"):
        flagged = [dict(m) for m in plain]
        flagged[1][key] = 0
        with pytest.raises(ConversationError, match=rf"training flag not read: 'messages'\[1\] has '{key}': give "
                           rf"--train-key {key}"):
            read({"messages": flagged}, ChatSettings("hf"))
    # ShareGPT turns carry their flags too (axolotl's `weight`)
    sharegpt = [{"from": "human", "value": "u"}, {"from": "gpt", "value": "a", "weight": 0}]
    with pytest.raises(ConversationError, match=r"'conversations'\[1\] has 'weight'"):
        read({"conversations": sharegpt}, ChatSettings("hf"), ("conversations",))
    with pytest.raises(ConversationError, match="no assistant turn"):
        read({"conversations": sharegpt}, ChatSettings("hf", train_key="weight"), ("conversations",))
    with pytest.raises(ConversationError, match="bad training flag.*'train' is 'yes'"):
        read({"messages": [dict(plain[0], train="yes")] + plain[1:]}, encoder.settings)
    with pytest.raises(ConversationError, match="no assistant turn.*--train-key train"):
        read({"messages": [dict(m, train=False) for m in plain]}, encoder.settings)


def test_qwen3_multi_turn_is_located_only_by_last_turn_or_one_document_per_turn(qwen3):
    directory, reference = qwen3
    with pytest.raises(ConversationError, match="turn not located.*--loss-on last.*--chat-documents turn"):
        encoder = encoder_for(directory)
        encoder.ids_and_mask(read({"messages": REASONING}, encoder.settings))
    # --loss-on last: the whole conversation as the template renders it, its last turn (with reasoning) trained
    encoder = encoder_for(directory, loss_on="last")
    ids, mask = encoder.ids_and_mask(read({"messages": REASONING}, encoder.settings))
    assert ids == reference_chat_ids(reference, REASONING)
    assert "count the pages" not in reference.decode(ids)  # past reasoning dropped by the template
    assert trained_text(reference, ids, mask) == "<think>\npages times words\n</think>\n\na lot<|im_end|>\n"
    # --chat-documents turn: each assistant turn a document of its own, rendered as it was generated
    encoder = encoder_for(directory, documents="turn")
    conversation = read({"messages": REASONING}, encoder.settings)
    key = encode_conversations(encoder, [conversation], ["r.jsonl:1"], "int32")
    assert key.rejected == () and key.lengths.tolist() == [len(reference_chat_ids(reference, REASONING[:2])),
                                                           len(reference_chat_ids(reference, REASONING))]
    first = key.tokens[: key.lengths[0]].tolist()
    assert first == reference_chat_ids(reference, REASONING[:2])
    assert trained_text(reference, first, key.loss_mask[: key.lengths[0]]) == (
        "<think>\ncount the pages\n</think>\n\nthree hundred pages<|im_end|>\n")
    assert trained_text(reference, key.tokens[key.lengths[0]:].tolist(), key.loss_mask[key.lengths[0]:]) == (
        "<think>\npages times words\n</think>\n\na lot<|im_end|>\n")


def test_one_document_per_turn_leaves_out_a_record_whole_when_one_turn_fails(chat_tokenizer_dir, chat_hf_tokenizer):
    # Llama 3's template cannot locate a turn that opens the conversation (<|begin_of_text|> comes before a first
    # message only); the record's later turn could be located, but no half record is written
    encoder = encoder_for(chat_tokenizer_dir, documents="turn")
    opens = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "how can I help"}]
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    conversations = [read({"messages": m}, encoder.settings) for m in (good, opens, good)]
    key = encode_conversations(encoder, conversations, ["r.jsonl:1", "r.jsonl:2", "r.jsonl:3"], "int32")
    assert [(location, reason) for location, reason, _ in key.rejected] == [
        ("r.jsonl:2", "turn not located in the rendering")]
    assert key.lengths.tolist() == [len(reference_chat_ids(chat_hf_tokenizer, good))] * 2
    assert len(key.loss_mask) == len(key.tokens) == sum(key.lengths)


def test_mistral_inst_turns_mask_exactly(chat_tokenizer_dir, chat_hf_tokenizer, tmp_path):
    template = tmp_path / "mistral.jinja"
    template.write_text(MISTRAL_TEMPLATE)
    encoder = encoder_for(chat_tokenizer_dir, template)
    messages = [{"role": "user", "content": "the long context"}, {"role": "assistant", "content": "holds tokens"},
                {"role": "user", "content": "and?"}, {"role": "assistant", "content": "many"}]
    ids, mask = encoder.ids_and_mask(read({"messages": messages}, encoder.settings))
    assert ids == reference_chat_ids(chat_hf_tokenizer, messages, chat_template=MISTRAL_TEMPLATE)
    assert trained_text(chat_hf_tokenizer, ids, mask) == "holds tokens<|eot_id|>many<|eot_id|>"


def test_llama31_tools_in_the_first_user_turn_and_a_json_tool_call(chat_tokenizer_dir, chat_hf_tokenizer, tmp_path):
    template = tmp_path / "llama31.jinja"
    template.write_text(LLAMA31_TEMPLATE)
    encoder = encoder_for(chat_tokenizer_dir, template, template_kwargs_keys=("tools",))
    ids, mask = encoder.ids_and_mask(read({"messages": TOOL_CONVERSATION, "tools": TOOLS}, encoder.settings))
    assert ids == reference_chat_ids(chat_hf_tokenizer, TOOL_CONVERSATION, tools=TOOLS, chat_template=LLAMA31_TEMPLATE)
    text = chat_hf_tokenizer.decode(ids)
    assert "Cutting Knowledge Date" in text and '"get_weather"' in text.split("<|eot_id|>")[1]  # tools, untrained
    assert trained_text(chat_hf_tokenizer, ids, mask) == (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>clear skies in Paris<|eot_id|>')


def test_a_task_of_one_conversation_the_template_refuses_is_a_rejected_record(chat_tokenizer_dir, tmp_path):
    # a record alone in its task (the last of a file, or one long enough to fill a task) is skippable as any other
    template = tmp_path / "mistral.jinja"
    template.write_text(MISTRAL_TEMPLATE)
    encoder = encoder_for(chat_tokenizer_dir, template)
    refused = read({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                 {"role": "assistant", "content": "a"}]}, encoder.settings)
    key = encode_conversations(encoder, [refused], ["m.jsonl:9"], "int32")
    assert [(location, reason) for location, reason, _ in key.rejected] == [
        ("m.jsonl:9", "refused by the chat template")]
    assert len(key.tokens) == len(key.lengths) == 0


def test_conversations_render_in_one_call_per_run_of_the_same_template_keywords(chat_tokenizer_dir):
    encoder = encoder_for(chat_tokenizer_dir, template_kwargs_keys=("tools",))
    calls = []
    render = encoder.tokenizer.apply_chat_template

    def recording(conversations, **kwargs):
        calls.append((len(conversations), "tools" in kwargs))
        return render(conversations, **kwargs)

    encoder.tokenizer.apply_chat_template = recording
    plain = [read({"messages": m}, encoder.settings) for m in PLAIN]
    tooled = read({"messages": PLAIN[0], "tools": TOOLS}, encoder.settings)
    encoder.encode_conversations(plain + [tooled] + plain, [""] * 7)
    wholes = [call for call in calls[:3]]
    assert wholes == [(3, False), (1, True), (3, False)]  # the whole renderings: three calls, not seven
