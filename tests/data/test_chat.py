"""chat.py: conversations read in every shape, ids exactly `apply_chat_template`'s, masks exactly the assistant
spans, and templates that cannot be masked refused."""

from __future__ import annotations

import pytest

from megatron_lc.data.chat import ChatEncoder
from megatron_lc.data.chat_records import ChatSettings, ConversationError, conversation_from_record
from tests.data.helpers import reference_chat_ids

CONVERSATIONS = [
    [{"role": "user", "content": "the long context of a book"}, {"role": "assistant", "content": "holds many tokens"}],
    [{"role": "system", "content": "every token counts"},
     {"role": "user", "content": "naïve café 数据 🙂 12345"},
     {"role": "assistant", "content": "  the book\n\nholds tokens  "},
     {"role": "user", "content": "and training?"},
     {"role": "assistant", "content": ""},
     {"role": "user", "content": "last question"},
     {"role": "assistant", "content": "a long answer of many tokens in training"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
     {"role": "user", "content": "no answer to this one"}],
]


def test_ids_are_exactly_apply_chat_template_and_the_mask_its_assistant_spans(chat_tokenizer_dir, chat_hf_tokenizer):
    encoder = ChatEncoder(chat_tokenizer_dir, ChatSettings("hf"))
    for messages in CONVERSATIONS:
        ids, mask = encoder.ids_and_mask(conversation_from_record({"messages": messages}, ("messages",), "assistant"))
        assert ids == reference_chat_ids(chat_hf_tokenizer, messages)
        expected = [0] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                start = len(reference_chat_ids(chat_hf_tokenizer, messages[:i], add_generation_prompt=True))
                end = len(reference_chat_ids(chat_hf_tokenizer, messages[: i + 1]))
                expected[start:end] = [1] * (end - start)
        assert mask.tolist() == expected
        # what is trained on, read back: each assistant content (the template trims it) and its end of turn
        trained = chat_hf_tokenizer.decode([t for t, m in zip(ids, mask) if m])
        assert trained == "".join(m["content"].strip() + "<|eot_id|>" for m in messages if m["role"] == "assistant")


def test_sharegpt_turns_give_the_ids_and_mask_of_the_same_openai_messages(chat_tokenizer_dir):
    encoder = ChatEncoder(chat_tokenizer_dir, ChatSettings("hf"))
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    messages = CONVERSATIONS[1]
    sharegpt = [{"from": names[m["role"]], "value": m["content"]} for m in messages]
    openai = encoder.ids_and_mask(conversation_from_record({"messages": messages}, ("messages",), "assistant"))
    shared = encoder.ids_and_mask(conversation_from_record({"conversations": sharegpt}, ("conversations",),
                                                           "assistant"))
    assert shared[0] == openai[0] and shared[1].tolist() == openai[1].tolist()


def test_prompt_completion_trains_only_on_the_completion(chat_tokenizer_dir, chat_hf_tokenizer):
    encoder = ChatEncoder(chat_tokenizer_dir, ChatSettings("hf"))
    keys = ("prompt", "completion")
    text = conversation_from_record({"prompt": "the question", "completion": "the answer"}, keys, "assistant")
    assert [m["role"] for m in text.messages] == ["user", "assistant"]
    ids, mask = encoder.ids_and_mask(text)
    assert chat_hf_tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "the answer<|eot_id|>"
    # TRL's conversational form: an assistant turn inside the prompt is context, not a target
    prompt = CONVERSATIONS[2][:3] + [{"role": "user", "content": "again"}]
    lists = conversation_from_record({"prompt": prompt, "completion": [{"role": "assistant", "content": "done"}]},
                                     keys, "assistant")
    ids, mask = encoder.ids_and_mask(lists)
    assert ids == reference_chat_ids(chat_hf_tokenizer, list(lists.messages))
    assert chat_hf_tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "done<|eot_id|>"


def test_loss_on_all_writes_no_mask_and_the_same_ids(chat_tokenizer_dir, chat_hf_tokenizer):
    encoder = ChatEncoder(chat_tokenizer_dir, ChatSettings("hf", "all"))
    conversation = conversation_from_record({"messages": CONVERSATIONS[2]}, ("messages",), "all")
    ids, mask = encoder.ids_and_mask(conversation)
    assert mask is None and ids == reference_chat_ids(chat_hf_tokenizer, CONVERSATIONS[2])


def test_a_template_file_renders_instead_of_the_tokenizers_own(chat_tokenizer_dir, chat_hf_tokenizer, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}"
                        "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
                        "<|end_header_id|>{% endif %}")
    encoder = ChatEncoder(chat_tokenizer_dir, ChatSettings(str(template)))
    messages = CONVERSATIONS[0]
    ids, mask = encoder.ids_and_mask(conversation_from_record({"messages": messages}, ("messages",), "assistant"))
    assert ids == reference_chat_ids(chat_hf_tokenizer, messages, chat_template=template.read_text())
    assert ids != reference_chat_ids(chat_hf_tokenizer, messages)
    assert chat_hf_tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "holds many tokens<|eot_id|>"


def test_a_template_that_renders_a_prefix_differently_is_one_record_error_naming_where(chat_tokenizer_dir, tmp_path):
    # renders the last message in a way earlier ones are not: messages[:i+1] is not a prefix of the whole
    template = tmp_path / "last.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if loop.last %} (last)"
                        "{% endif %}<|eot_id|>{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    encoder = ChatEncoder(chat_tokenizer_dir, ChatSettings(str(template)))
    conversation = conversation_from_record({"messages": CONVERSATIONS[1]}, ("messages",), "assistant")
    with pytest.raises(ConversationError, match=r"^turn not located in the rendering: messages\[2\] is trained, but "
                       r"the template renders messages\[:2\] with the generation prompt as text that parts .* at character \d+ "
                       r"\('<\|eot_id\|>assistant: .* in the whole, ' \(last\)<\|eot_id\|>.* in the prefix\).*--loss-on last"
                       r".*--chat-documents turn"):
        encoder.ids_and_mask(conversation, "chat.jsonl:7")
    # with --loss-on all there is no prefix to compare: the whole renders as it is
    ChatEncoder(chat_tokenizer_dir, ChatSettings(str(template), "all")).ids_and_mask(conversation)


def test_a_template_that_refuses_a_conversation_is_a_conversation_error(chat_tokenizer_dir, tmp_path):
    template = tmp_path / "strict.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                        "{% endif %}{{ m['content'] }}{% endfor %}")
    encoder = ChatEncoder(chat_tokenizer_dir, ChatSettings(str(template)))
    with pytest.raises(ConversationError, match="no system") as error:
        encoder.ids_and_mask(conversation_from_record({"messages": CONVERSATIONS[1]}, ("messages",), "assistant"))
    assert error.value.reason == "refused by the chat template"


@pytest.mark.parametrize("record, reason, detail", [
    ({"messages": "hello"}, "conversation not a list", "'messages' is a str"),
    ({"messages": {"role": "user"}}, "conversation not a list", "'messages' is a dict"),
    ({"messages": []}, "empty conversation", ""),
    ({"messages": ["hi"]}, "message not an object", "messages[0] is a str"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role", "messages[0]: role 'robot'"),
    ({"messages": [{"content": "x"}]}, "unknown role", "role None"),
    ({"messages": [{"from": "bot", "value": "x"}]}, "unknown role", "from 'bot'"),
    ({"messages": [{"role": "user"}]}, "missing content", "messages[0] has no 'content'"),
    ({"messages": [{"role": "user", "content": None}]}, "missing content", "null content is read with tool_calls"),
    ({"messages": [{"role": "assistant", "content": None}]}, "missing content", ""),
    ({"messages": [{"from": "human"}]}, "missing content", "has no 'value'"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "non-text content part",
     "messages[0].content[0] is not a"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "non-text content part",
     "messages[0].content[0] is a 'image_url' part"),
    ({"messages": [{"role": "user", "content": 3}]}, "non-string content", "is a int"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}, "no assistant turn", ""),
    ({"text": "x"}, "missing key 'messages'", ""),
])
def test_each_bad_conversation_is_named_by_its_category_and_place(record, reason, detail):
    with pytest.raises(ConversationError) as error:
        conversation_from_record(record, ("messages",), "assistant")
    assert error.value.reason == reason and detail in error.value.detail


def test_a_conversation_without_an_assistant_turn_is_read_with_loss_on_all():
    record = {"messages": [{"role": "user", "content": "u"}]}
    assert len(conversation_from_record(record, ("messages",), "all").messages) == 1
    with pytest.raises(ConversationError, match="no assistant turn"):
        conversation_from_record({"prompt": "p", "completion": [{"role": "user", "content": "u"}]},
                                 ("prompt", "completion"), "assistant")


def test_prefixes_cut_at_special_tokens_equal_prefixes_encoded_whole(chat_tokenizer_dir, chat_hf_tokenizer):
    """The encoder takes a prefix's ids from the whole's up to its last special token: the same ids as encoding
    the prefix whole, which it does with transformers' own call (`backend` None) and where the template writes
    no special token at all."""
    fast = ChatEncoder(chat_tokenizer_dir, ChatSettings("hf"))
    assert fast.split_ids and fast.backend is not None
    whole = ChatEncoder(chat_tokenizer_dir, ChatSettings("hf"))
    whole.split_ids, whole.backend = frozenset(), None  # every prefix encoded whole, by transformers' call
    conversations = [conversation_from_record({"messages": m}, ("messages",), "assistant") for m in CONVERSATIONS]
    locations = [f"c.jsonl:{i}" for i in range(len(conversations))]
    for a, b in zip(fast.encode_conversations(conversations, locations),
                    whole.encode_conversations(conversations, locations)):
        assert a.ids == b.ids and a.mask.tolist() == b.mask.tolist()


def test_a_template_without_special_tokens_masks_exactly(chat_tokenizer_dir, chat_hf_tokenizer, tmp_path):
    template = tmp_path / "words.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    encoder = ChatEncoder(chat_tokenizer_dir, ChatSettings(str(template)))
    messages = CONVERSATIONS[1]
    ids, mask = encoder.ids_and_mask(conversation_from_record({"messages": messages}, ("messages",), "assistant"))
    assert ids == reference_chat_ids(chat_hf_tokenizer, messages, chat_template=template.read_text())
    expected = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(reference_chat_ids(chat_hf_tokenizer, messages[:i], add_generation_prompt=True,
                                           chat_template=template.read_text()))
            end = len(reference_chat_ids(chat_hf_tokenizer, messages[: i + 1], chat_template=template.read_text()))
            expected[start:end] = [1] * (end - start)
    assert mask.tolist() == expected and sum(expected) > 0


def test_llama3s_template_cannot_mask_a_conversation_that_opens_with_the_assistant(chat_tokenizer_dir):
    # Llama 3's template writes <|begin_of_text|> before a first message only: the generation prompt of no messages
    # is not a prefix of the conversation's rendering, so the assistant's span cannot be taken from it
    encoder = ChatEncoder(chat_tokenizer_dir, ChatSettings("hf"))
    conversation = conversation_from_record({"messages": [{"role": "assistant", "content": "hello"}]}, ("messages",),
                                            "assistant")
    with pytest.raises(ConversationError, match=r"messages\[:0\] with the generation prompt as text that parts from "
                       r"the whole conversation's at character 2 \('begin_of_text\|>"):
        encoder.ids_and_mask(conversation, "a.jsonl:2")


# Mistral's turns, with a few words after [/INST] that open the assistant's turn: a prefix's tail after its last
# special token is text, encoded alone by the shortcut.
MISTRAL_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %} Answer: {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} Answer:{% endif %}")


@pytest.fixture(scope="module")
def metaspace_tokenizer_dir(tmp_path_factory, corpus_texts) -> str:
    """A SentencePiece-style tokenizer (Metaspace, a space marker prepended to the first piece only) with
    Mistral-like [INST] specials: the prefix shortcut must hold for it too."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus_texts, trainer)
    directory = tmp_path_factory.mktemp("metaspace")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": MISTRAL_LIKE_TEMPLATE}))
    return str(directory)


def test_a_metaspace_tokenizer_masks_exactly_through_the_shortcut(metaspace_tokenizer_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(metaspace_tokenizer_dir, local_files_only=True)
    fast = ChatEncoder(metaspace_tokenizer_dir, ChatSettings("hf"))
    assert fast.split_ids
    whole = ChatEncoder(metaspace_tokenizer_dir, ChatSettings("hf"))
    whole.split_ids, whole.backend = frozenset(), None
    conversations = [conversation_from_record({"messages": [m for m in c if m["role"] != "system"]}, ("messages",),
                                              "assistant") for c in CONVERSATIONS[:2]]
    for a, b, conversation in zip(fast.encode_conversations(conversations, ["", ""]),
                                  whole.encode_conversations(conversations, ["", ""]), conversations):
        assert a.ids == b.ids == reference_chat_ids(reference, list(conversation.messages))
        assert a.mask.tolist() == b.mask.tolist() and a.mask.sum() > 0
