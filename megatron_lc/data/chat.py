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


@dataclass(frozen=True)
class _Encoding:
    """A text's ids and their character spans, from transformers' call (as the backend's `Encoding` has them)."""

    ids: list[int]
    offsets: list[tuple[int, int]]

    def token_to_chars(self, index: int) -> tuple[int, int]:
        return self.offsets[index]


@dataclass(frozen=True)
class EncodedConversation:
    """One conversation's ids and (with `--loss-on assistant`) its uint8 loss mask; or why it was left out."""

    ids: list[int]
    mask: np.ndarray | None
    error: ConversationError | None = None


# Distinct prefix tails (a header's text after its last special token) whose ids a ChatEncoder keeps, and the
# longest kept (a prefix encoded whole is not kept).
TAIL_CACHE_SIZE = 512
TAIL_CACHE_CHARS = 256


class ChatEncoder:
    """Renders and encodes conversations with one tokenizer and template.

    The mask needs the ids of each prefix rendering. A prefix's text is usually a prefix of the whole's text
    (checked), and a fast tokenizer splits its input at its special tokens before anything else (normalizer,
    pre-tokenizer, model see each piece alone): so a prefix's ids are the whole's ids up to the last special token
    written in the text that ends by the cut, then the ids of the text from that token's start to the cut, encoded
    alone (usually a few characters: a header's tail). Encoded so, a conversation costs about one encoding of its
    whole text instead of one per turn; the result is the prefix's own encoding. Where no such token precedes the
    cut, or the texts are no prefixes, the prefix is encoded whole.
    """

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
        self.split_tokens = self._split_tokens()
        self.split_ids = frozenset(self.split_tokens)
        self._split_array = np.fromiter(sorted(self.split_ids), dtype=np.int64, count=len(self.split_ids))
        self.backend = self._plain_backend()
        self._tails: dict[str, list[int]] = {}

    def _split_tokens(self) -> dict[int, str]:
        """The added tokens a fast tokenizer cuts its input at before normalizing, id -> text: special, not
        normalized, and not stripping or matching whole words (each changes what lies beside it)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None) if getattr(self.tokenizer, "is_fast", False) \
            else None
        if backend is None:
            return {}
        return {token_id: token.content for token_id, token in backend.get_added_tokens_decoder().items()
                if token.special and not (token.normalized or token.lstrip or token.rstrip or token.single_word)}

    def _plain_backend(self) -> Any:
        """The fast tokenizer's backend where calling it is what the transformers call does (no truncation, padding
        or split special tokens configured: the call would switch them off), else None (transformers' call)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None) if getattr(self.tokenizer, "is_fast", False) \
            else None
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return None
        if getattr(self.tokenizer, "split_special_tokens", False) or getattr(backend, "encode_special_tokens", False):
            return None
        return backend

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

    def encode(self, texts: Sequence[str]) -> list[Any]:
        """Each text's encoding (`.ids`, `.offsets`: each token's character span) as `apply_chat_template`
        encodes its rendering: without special tokens added, truncation or padding, special tokens in the text
        read as such."""
        if not texts:
            return []
        if self.backend is not None:
            return self.backend.encode_batch(list(texts), add_special_tokens=False)
        encoded = self.tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=bool(self.split_ids),
                                 return_attention_mask=False, return_token_type_ids=False)
        offsets = encoded.get("offset_mapping") or [[]] * len(texts)
        return [_Encoding(ids, spans) for ids, spans in zip(encoded["input_ids"], offsets)]

    def ids_and_mask(self, conversation: Conversation, location: str = "") -> tuple[list[int], np.ndarray | None]:
        """One conversation's ids and mask; a `ConversationError` when the template refuses it."""
        (encoded,) = self.encode_conversations([conversation], [location])
        return encoded.ids, encoded.mask

    def encode_conversations(self, conversations: Sequence[Conversation],
                             locations: Sequence[str]) -> list[EncodedConversation]:
        """Each conversation's ids and mask (each template refusal in its entry); a `TemplateNotPrefixError`
        naming the first conversation whose prefixes the template renders differently."""
        try:
            wholes = self.render([c.messages for c in conversations], False)
        except ConversationError as error:
            return self._one_by_one(conversations, locations, error)
        if not self.settings.masked:
            return [EncodedConversation(encoding.ids, None) for encoding in self.encode(wholes)]
        cuts = [(n, i) for n, c in enumerate(conversations) for i in c.trained]
        inner = [(n, i) for n, i in cuts if i + 1 < len(conversations[n].messages)]  # the last ends with the whole
        try:
            starts = self.render([conversations[n].messages[:i] for n, i in cuts], True)
            ends = self.render([conversations[n].messages[: i + 1] for n, i in inner], False)
        except ConversationError as error:
            return self._one_by_one(conversations, locations, error)
        encoded = self.encode(wholes)
        ids = [encoding.ids for encoding in encoded]
        anchors = [self._anchors(text, whole, encoding) for text, whole, encoding in zip(wholes, ids, encoded)]
        start_ids = self._prefixes(wholes, ids, anchors, [n for n, _ in cuts], starts)
        inner_ids = iter(self._prefixes(wholes, ids, anchors, [n for n, _ in inner], ends))
        results = [EncodedConversation(whole, np.zeros(len(whole), dtype=np.uint8)) for whole in ids]
        for (n, i), start in zip(cuts, start_ids):
            whole = results[n].ids
            end = next(inner_ids) if i + 1 < len(conversations[n].messages) else whole
            self._check_prefix(start, whole, i, True, locations[n])
            self._check_prefix(end, whole, i + 1, False, locations[n])
            results[n].mask[len(start): len(end)] = 1
        return results

    def _one_by_one(self, conversations: Sequence[Conversation], locations: Sequence[str],
                    error: ConversationError) -> list[EncodedConversation]:
        """After the template refused one of a batch: each encoded alone, to find which (one alone: its error)."""
        if len(conversations) == 1:
            raise error
        results = []
        for conversation, location in zip(conversations, locations, strict=True):
            try:
                results.append(self.encode_conversations([conversation], [location])[0])
            except ConversationError as refused:
                results.append(EncodedConversation([], None, refused))
        return results

    def _anchors(self, text: str, whole: list[int], encoding: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The token indices of the split tokens found in the whole's text (an id the model gives for something
        else, such as an unknown character's <unk>, is no cut), and where each starts and ends in the text."""
        empty = np.zeros(0, np.int64)
        if not self.split_ids:
            return empty, empty, empty
        index, starts, ends = [], [], []
        for k in np.flatnonzero(np.isin(np.asarray(whole, dtype=np.int64), self._split_array)).tolist():
            start, end = encoding.token_to_chars(k)
            if text[start:end] == self.split_tokens[whole[k]]:
                index.append(k)
                starts.append(start)
                ends.append(end)
        return (np.asarray(index, np.int64), np.asarray(starts, np.int64), np.asarray(ends, np.int64)) if index \
            else (empty, empty, empty)

    def _prefixes(self, texts: list[str], ids: list[list[int]], anchors: list, owners: list[int],
                  prefixes: list[str]) -> list[list[int]]:
        """The ids of each of `prefixes` (a rendering of the start of conversation `owners[k]`): the whole's ids to
        the last split token ending by the cut, then the rest encoded alone (all in one call); a prefix that is
        not one as text, or has no split token before its cut, encoded whole."""
        heads: list[list[int]] = []
        tails: list[str] = []
        for n, prefix in zip(owners, prefixes, strict=True):
            index, starts, ends = anchors[n]
            last = int(np.searchsorted(ends, len(prefix), side="right")) - 1
            if not texts[n].startswith(prefix) or last < 0:
                heads.append([])
                tails.append(prefix)
                continue
            heads.append(ids[n][: int(index[last])])
            tails.append(texts[n][int(starts[last]): len(prefix)])
        return [head + tail for head, tail in zip(heads, self._encode_tails(tails))]

    def _encode_tails(self, tails: list[str]) -> list[list[int]]:
        """The ids of each tail, each distinct text encoded once (a template's headers repeat turn after turn): the
        last few hundred distinct short ones are kept."""
        new = list(dict.fromkeys(tail for tail in tails if tail not in self._tails))
        encoded = {tail: encoding.ids for tail, encoding in zip(new, self.encode(new))}
        found = [self._tails[tail] if tail in self._tails else encoded[tail] for tail in tails]
        self._tails.update((tail, ids) for tail, ids in encoded.items() if len(tail) <= TAIL_CACHE_CHARS)
        while len(self._tails) > TAIL_CACHE_SIZE:
            del self._tails[next(iter(self._tails))]
        return found

    def _check_prefix(self, prefix: list[int], whole: list[int], count: int, generation: bool, location: str) -> None:
        if whole[: len(prefix)] == prefix:
            return
        differ = next((k for k, (a, b) in enumerate(zip(prefix, whole)) if a != b), min(len(prefix), len(whole)))
        where = f"{location}: " if location else ""
        prompt = " with add_generation_prompt=True" if generation else ""
        raise TemplateNotPrefixError(
            f"{where}--chat-template {self.settings.template}: the rendering of messages[:{count}]{prompt} is not a "
            f"prefix of the whole conversation's (its ids differ from token {differ}), so the assistant tokens "
            "cannot be told from the rest: use a template that renders earlier turns the same in every prefix, or "
            "--loss-on all")
