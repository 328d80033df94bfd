"""Chat records in, validated conversations out: the messages a template renders, the turns trained on, and the
template keywords a record carries.

A conversation record is read in one of three shapes (see docs/sft.md):

- OpenAI's `messages`: a list of `{"role": ..., "content": ...}` (roles `CHAT_ROLES`); an assistant message
  with `tool_calls` may have `content` null or absent; a content given as a list of parts is read as its
  `{"type": "text"}` parts' texts joined by one space, as transformers' server hands such a message to a
  text-only model (any other part type is refused);
- ShareGPT's `conversations`: a list of `{"from": ..., "value": ...}` (`from` in `SHAREGPT_ROLES`: human, gpt,
  system, function_call, observation, and the OpenAI names), read as the OpenAI messages they stand for;
- prompt/completion: two fields, each a string (the user's prompt, the assistant's completion) or a list of
  OpenAI messages (TRL's conversational form); only the completion's assistant messages are trained on.

Which messages are trained on: with `--loss-on assistant` every assistant message (of the completion); with
`--loss-on last` the last of those only; a message's own flag under `--train-key` (true/false, 1/0) overrides
either, for any role. A message key that reads as a training flag but is not the one named is refused, never
ignored. Record fields named by `--chat-template-kwargs-keys` (such as `tools`) are passed to the template as
keywords; a `tools` or `documents` field not named is refused (the template would never see it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence, get_args

LossOn = Literal["assistant", "last", "all"]
LOSS_ON_CHOICES: tuple[LossOn, ...] = get_args(LossOn)
ChatDocuments = Literal["conversation", "turn"]
CHAT_DOCUMENTS_CHOICES: tuple[ChatDocuments, ...] = get_args(ChatDocuments)

# `--chat-template` value that means the tokenizer's own template.
OWN_TEMPLATE = "hf"

CHAT_ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}

# Message keys peers read as per-message training flags (axolotl's `training`/`train`/`weight`, ms-swift's `loss`,
# LLaMA-Factory-style masks): one present but not named by --train-key is refused, as training it silently would
# go against what its author meant.
TRAINING_FLAG_KEYS = ("train", "training", "trainable", "train_on", "loss", "weight", "mask", "masked", "no_loss",
                      "ignore_loss")
# Record fields transformers' apply_chat_template takes as its own arguments: one present but not passed is refused.
TEMPLATE_ARGUMENT_KEYS = ("tools", "documents")


@dataclass(frozen=True)
class ChatSettings:
    """`--chat-template` (OWN_TEMPLATE or a Jinja file), `--loss-on`, `--chat-documents`, `--train-key` and
    `--chat-template-kwargs-keys`."""

    template: str
    loss_on: LossOn = "assistant"
    documents: ChatDocuments = "conversation"
    train_key: str | None = None
    template_kwargs_keys: tuple[str, ...] = ()

    @property
    def template_file(self) -> str | None:
        return None if self.template == OWN_TEMPLATE else self.template

    @property
    def masked(self) -> bool:
        """Whether a loss mask is written: `--loss-on all` trains on every token, as a dataset without one."""
        return self.loss_on != "all"


class ConversationError(ValueError):
    """A record that is not a conversation: `reason` is its category (counted by --skip-invalid), `detail`
    where in the record and what."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Conversation:
    """Validated OpenAI messages, the indices of those trained on (in order), and the template keywords."""

    messages: tuple[dict[str, Any], ...]
    trained: tuple[int, ...] = ()
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def chars(self) -> int:
        """The characters the template renders, about (contents, tool calls and keywords as JSON)."""
        total = sum(len(m.get("content") or "") + (len(str(m["tool_calls"])) if m.get("tool_calls") else 0)
                    for m in self.messages)
        return total + sum(len(str(value)) for value in self.template_kwargs.values())

    def turns(self) -> list["Conversation"]:
        """One conversation per trained message: the messages up to it, only it trained (`--chat-documents
        turn`)."""
        return [Conversation(self.messages[: i + 1], (i,), self.template_kwargs) for i in self.trained]


def conversation_from_record(record: Mapping[str, Any], keys: Sequence[str], loss_on: LossOn,
                             train_key: str | None = None,
                             template_kwargs_keys: Sequence[str] = ()) -> Conversation:
    """The conversation of one record read under `keys` (one key: a message list; two: prompt, completion);
    a `ConversationError` naming the category and the message when it is not one."""
    if len(keys) == 2:
        prompt = _part(record, keys[0], "user")
        completion = _part(record, keys[1], "assistant")
        messages, first_trained = prompt + completion, len(prompt)
    else:
        messages, first_trained = _messages(record, keys[0]), 0
    if not messages:
        raise ConversationError("empty conversation", f"{keys[0]!r} is an empty list")
    kwargs = _template_kwargs(record, template_kwargs_keys)
    where = f"{keys[1]!r}" if len(keys) == 2 else f"{keys[0]!r}"
    trained = _trained(messages, first_trained, loss_on, train_key, where)
    if loss_on != "all" and not trained:
        flags = f" (or none left by its --train-key {train_key} flags)" if train_key else ""
        raise ConversationError("no assistant turn", f"no assistant message in {where}{flags}: no token to train on "
                                "(--loss-on all trains on every token)")
    if train_key is not None:  # the flag is data about the message, not part of it: the template never sees it
        messages = tuple({k: v for k, v in m.items() if k != train_key} for m in messages)
    return Conversation(messages, trained, kwargs)


def _trained(messages: Sequence[dict[str, Any]], first_trained: int, loss_on: LossOn, train_key: str | None,
             where: str) -> tuple[int, ...]:
    """The trained messages' indices: assistant messages from `first_trained` on, each message's own flag
    overriding; with `--loss-on last` the last of those only."""
    if loss_on == "all":
        return ()
    trained = []
    for index, message in enumerate(messages):
        default = index >= first_trained and message["role"] == "assistant"
        flag = _training_flag(message, train_key, f"{where}[{index}]")
        if (default if flag is None else flag):
            trained.append(index)
    return tuple(trained[-1:]) if loss_on == "last" else tuple(trained)


def _training_flag(message: Mapping[str, Any], train_key: str | None, where: str) -> bool | None:
    """The message's own training flag under `train_key` (None: none given); a training-flag-like key not named
    is a `ConversationError`."""
    for key in TRAINING_FLAG_KEYS:
        if key in message and key != train_key:
            raise ConversationError("training flag not read", f"{where} has {key!r}: give --train-key {key} to "
                                    "honour it per message, or drop the key from the data")
    if train_key is None or message.get(train_key) is None:
        return None
    value = message[train_key]
    if isinstance(value, bool) or (isinstance(value, (int, float)) and value in (0, 1)):
        return bool(value)
    raise ConversationError("bad training flag", f"{where}: {train_key!r} is {value!r} (true/false or 1/0)")


def _template_kwargs(record: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The record's fields named by --chat-template-kwargs-keys (absent, null or empty: not passed, as a template
    renders no tools for an empty list); a template argument field not named, and not empty, is a
    `ConversationError`."""
    for key in TEMPLATE_ARGUMENT_KEYS:
        if record.get(key) not in (None, [], "", "[]") and key not in names:
            raise ConversationError(f"{key!r} not passed to the template",
                                    f"the record has {key!r}: give --chat-template-kwargs-keys {key} to render it "
                                    "(the model would otherwise learn calls to what it never saw described)")
    kwargs = {key: record[key] for key in names if record.get(key) not in (None, [], "", "[]")}
    if isinstance(kwargs.get("tools"), str):  # tools stored as a JSON string (a column of one type)
        try:
            kwargs["tools"] = json.loads(kwargs["tools"])
        except json.JSONDecodeError as error:
            raise ConversationError("bad tools", f"'tools' is a string that is not JSON: {error}") from None
    return kwargs


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
    """One message as OpenAI's: ShareGPT's from/value renamed, the other fields of either kept."""
    where = f"{key}[{index}]"
    if not isinstance(item, Mapping):
        raise ConversationError("message not an object", f"{where} is a {type(item).__name__}")
    if "role" not in item and "from" in item:
        role, content_key = SHAREGPT_ROLES.get(item["from"]) if isinstance(item["from"], str) else None, "value"
        if role is None:
            raise ConversationError("unknown role", f"{where}: from {item['from']!r} (ShareGPT's are "
                                    f"{', '.join(SHAREGPT_ROLES)})")
        message = {"role": role, **{k: v for k, v in item.items() if k not in ("from", "value")}}
    else:
        role, content_key = item.get("role"), "content"
        if role not in CHAT_ROLES:
            raise ConversationError("unknown role", f"{where}: role {role!r} (known: {', '.join(CHAT_ROLES)})")
        message = dict(item)
    content = item.get(content_key)
    if content is None:
        if role == "assistant" and item.get("tool_calls"):
            return message  # a tool call alone: the template renders its tool_calls
        raise ConversationError("missing content", f"{where} has no {content_key!r}"
                                + (" (null content is read with tool_calls only)" if content_key in item else ""))
    message["content"] = _text(content, f"{where}.{content_key}")
    return message


def _text(content: Any, where: str) -> str:
    """A content's text: a string, or a list of text parts joined by one space."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ConversationError("non-string content", f"{where} is a {type(content).__name__}")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a {kind!r} part" if kind not in (None, "text") else "not a {'type': 'text', 'text': str} part"
            raise ConversationError("non-text content part", f"{where}[{index}] is {what}: only text parts are read")
        texts.append(part["text"])
    return " ".join(texts)
