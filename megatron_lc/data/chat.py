"""Conversations in, token ids and a loss mask out.

A conversation record is read in one of three shapes (see docs/sft.md):

- OpenAI's `messages`: a list of `{"role": ..., "content": ...}` (roles `CHAT_ROLES`);
- ShareGPT's `conversations`: a list of `{"from": ..., "value": ...}` (`from` in `SHAREGPT_ROLES`: human, gpt,
  system, and the OpenAI names user and assistant), read as the OpenAI messages they stand for;
- prompt/completion: two fields, each a string (the user's prompt, the assistant's completion) or a list of
  OpenAI messages (TRL's conversational form); only the completion's assistant messages are trained on.

A document's ids are exactly `tokenizer.apply_chat_template(messages)`: the template rendered to text, and the
text encoded without added special tokens, as transformers does. Its loss mask (`loss_mask.py`'s format) marks,
for each trained assistant message i, the ids that rendering `messages[:i + 1]` adds beyond rendering
`messages[:i]` with the generation prompt: the message's content and its end of turn, not its header. A
template whose rendering of such a prefix is not a prefix of the whole rendering (in ids) cannot be masked
this way; it is refused (`TemplateNotPrefixError`), never masked wrongly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import numpy as np

LossOn = Literal["assistant", "all"]
LOSS_ON_CHOICES: tuple[LossOn, ...] = ("assistant", "all")

# `--chat-template` value that means the tokenizer's own template.
OWN_TEMPLATE = "hf"

CHAT_ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class ChatSettings:
    """`--chat-template` (OWN_TEMPLATE or a Jinja file) and `--loss-on`."""

    template: str
    loss_on: LossOn = "assistant"

    @property
    def template_file(self) -> str | None:
        return None if self.template == OWN_TEMPLATE else self.template

    @property
    def masked(self) -> bool:
        """Whether a loss mask is written: `--loss-on all` trains on every token, as a dataset without one."""
        return self.loss_on == "assistant"


class ConversationError(ValueError):
    """A record that is not a conversation: `reason` is its category (counted by --skip-invalid), `detail`
    where in the record and what."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class TemplateNotPrefixError(ValueError):
    """The template renders a prefix of the conversation as something that is not a prefix of the whole."""


@dataclass(frozen=True)
class Conversation:
    """Validated OpenAI messages; assistant messages from `first_trained` on are trained on."""

    messages: tuple[dict[str, Any], ...]
    first_trained: int = 0

    @property
    def chars(self) -> int:
        return sum(len(message["content"]) for message in self.messages)

    @property
    def trained(self) -> list[int]:
        """Indices of the trained assistant messages."""
        return [i for i in range(self.first_trained, len(self.messages)) if self.messages[i]["role"] == "assistant"]


def conversation_from_record(record: Mapping[str, Any], keys: Sequence[str], loss_on: LossOn) -> Conversation:
    """The conversation of one record read under `keys` (one key: a message list; two: prompt, completion);
    a `ConversationError` naming the category and the message when it is not one."""
    if len(keys) == 2:
        prompt = _part(record, keys[0], "user")
        completion = _part(record, keys[1], "assistant")
        conversation = Conversation(prompt + completion, first_trained=len(prompt))
    else:
        conversation = Conversation(_messages(record, keys[0]))
    if not conversation.messages:
        raise ConversationError("empty conversation", f"{keys[0]!r} is an empty list")
    if loss_on == "assistant" and not conversation.trained:
        where = f"{keys[1]!r}" if len(keys) == 2 else f"{keys[0]!r}"
        raise ConversationError("no assistant turn", f"no assistant message in {where}: no token to train on "
                                "(--loss-on all trains on every token)")
    return conversation


def _part(record: Mapping[str, Any], key: str, role: str) -> tuple[dict[str, Any], ...]:
    """A prompt or completion: a string is one message of `role`, a list is messages."""
    value = _field(record, key)
    if isinstance(value, str):
        return ({"role": role, "content": value},)
    return _messages(record, key)


def _field(record: Mapping[str, Any], key: str) -> Any:
    value = record.get(key)
    if value is None:
        raise ConversationError(f"missing key {key!r}")
    return value


def _messages(record: Mapping[str, Any], key: str) -> tuple[dict[str, Any], ...]:
    value = _field(record, key)
    if not isinstance(value, list):
        raise ConversationError("conversation not a list", f"{key!r} is a {type(value).__name__}")
    return tuple(_message(item, key, index) for index, item in enumerate(value))


def _message(item: Any, key: str, index: int) -> dict[str, Any]:
    """One message as OpenAI's: ShareGPT's from/value renamed, other fields of an OpenAI message kept."""
    where = f"{key}[{index}]"
    if not isinstance(item, Mapping):
        raise ConversationError("message not an object", f"{where} is a {type(item).__name__}")
    if "role" not in item and "from" in item:
        role, content_key = SHAREGPT_ROLES.get(item["from"]) if isinstance(item["from"], str) else None, "value"
        if role is None:
            raise ConversationError("unknown role", f"{where}: from {item['from']!r} (ShareGPT's are "
                                    f"{', '.join(SHAREGPT_ROLES)})")
        message = {"role": role}
    else:
        role, content_key = item.get("role"), "content"
        if role not in CHAT_ROLES:
            raise ConversationError("unknown role", f"{where}: role {role!r} (known: {', '.join(CHAT_ROLES)})")
        message = dict(item)
    content = item.get(content_key)
    if content is None:
        raise ConversationError("missing content", f"{where} has no {content_key!r}")
    if not isinstance(content, str):
        raise ConversationError("non-string content", f"{where}: {content_key!r} is a {type(content).__name__}")
    message["content"] = content
    return message


def load_chat_tokenizer(model_path: str) -> Any:
    """The transformers tokenizer of a local tokenizer directory (or of a `tokenizer.json`'s directory), as
    `AutoTokenizer.from_pretrained` loads it: the object whose `apply_chat_template` the ids must equal."""
    from transformers import AutoTokenizer

    directory = model_path if os.path.isdir(model_path) else os.path.dirname(os.path.abspath(model_path))
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def read_template_file(path: str) -> str:
    """A Jinja chat template file's text; a `ValueError` naming the file and line of a syntax error."""
    import jinja2

    with open(path, encoding="utf-8") as stream:
        text = stream.read()
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"--chat-template {path}:{error.lineno}: {error.message}") from None
    return text


class ChatEncoder:
    """Renders and encodes conversations with one tokenizer and template."""

    def __init__(self, model_path: str, settings: ChatSettings) -> None:
        self.settings = settings
        self.tokenizer = load_chat_tokenizer(model_path)
        if settings.template_file is not None:
            self.template: str | None = read_template_file(settings.template_file)
        else:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(f"--chat-template {OWN_TEMPLATE}: the tokenizer at {model_path} has no chat template "
                                 "(tokenizer_config.json's chat_template, or chat_template.jinja): give --chat-template "
                                 "FILE.jinja")
            self.template = None  # the tokenizer's own, as apply_chat_template picks it

    def render(self, conversations: Sequence[Sequence[dict]], add_generation_prompt: bool) -> list[str]:
        """Each conversation's text; a `ConversationError` when the template refuses one."""
        if not conversations:
            return []
        import jinja2

        try:
            texts = self.tokenizer.apply_chat_template([list(c) for c in conversations], tokenize=False,
                                                       chat_template=self.template,
                                                       add_generation_prompt=add_generation_prompt)
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as error:
            raise ConversationError("refused by the chat template", f"{type(error).__name__}: {error}") from None
        return [texts] if isinstance(texts, str) else list(texts)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids as `apply_chat_template` encodes its rendering: no special tokens added."""
        if not texts:
            return []
        return self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]

    def ids_and_mask(self, conversation: Conversation, location: str = "") -> tuple[list[int], np.ndarray | None]:
        """The conversation's ids and, with `--loss-on assistant`, its uint8 loss mask."""
        messages = conversation.messages
        if not self.settings.masked:
            return self.encode(self.render([messages], False))[0], None
        trained = conversation.trained
        starts = self.render([messages[:i] for i in trained], True)
        ends = self.render([messages[: i + 1] for i in trained if i + 1 < len(messages)], False)
        whole, *prefixes = self.encode(self.render([messages], False) + starts + ends)
        start_ids, end_ids = prefixes[: len(starts)], iter(prefixes[len(starts):])
        mask = np.zeros(len(whole), dtype=np.uint8)
        for index, start in zip(trained, start_ids):
            end = next(end_ids) if index + 1 < len(messages) else whole  # the last message ends with the whole
            self._check_prefix(start, whole, index, True, location)
            self._check_prefix(end, whole, index + 1, False, location)
            mask[len(start): len(end)] = 1
        return whole, mask

    def _check_prefix(self, prefix: list[int], whole: list[int], count: int, generation: bool, location: str) -> None:
        if whole[: len(prefix)] == prefix:
            return
        differ = next((k for k, (a, b) in enumerate(zip(prefix, whole)) if a != b), len(whole))
        where = f"{location}: " if location else ""
        prompt = " with add_generation_prompt=True" if generation else ""
        raise TemplateNotPrefixError(
            f"{where}--chat-template {self.settings.template}: the rendering of messages[:{count}]{prompt} is not a "
            f"prefix of the whole conversation's (its ids differ from token {differ}), so the assistant tokens "
            "cannot be told from the rest: use a template that renders earlier turns the same in every prefix, or "
            "--loss-on all")
