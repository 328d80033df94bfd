"""Conversations (`chat_records.py`) in, token ids and a loss mask out.

A document's ids are exactly `tokenizer.apply_chat_template(messages, **template_kwargs)`: the template rendered
to text, and the text encoded without added special tokens, as transformers does. Its loss mask (`loss_mask.py`'s
format) marks, for each trained message i, what rendering `messages[:i + 1]` adds beyond rendering `messages[:i]`
(with the generation prompt before an assistant message): the message's content and its end of turn, not its
header. Where those prefix renderings are prefixes of the whole in ids, the mask is those ids; where they are
prefixes in text only (a header's last characters and the content's first merge into one token, as ChatML's
"\n" and a content opening with "\n" do), a token is trained when its characters overlap the span, as
transformers' `return_assistant_tokens_mask` marks a generation block. A record whose prefix renderings are not
prefixes of the whole even in text (a template that rewrites earlier turns, as Qwen3's drops past reasoning) is
a `ConversationError` naming where they part: `--loss-on last` or `--chat-documents turn` train it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from megatron_lc.data.chat_records import OWN_TEMPLATE, ChatSettings, Conversation, ConversationError


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
    """One conversation's ids and (unless `--loss-on all`) its uint8 loss mask; or why it was left out."""

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

    def render(self, conversations: Sequence[Sequence[dict]], add_generation_prompt: bool,
               kwargs: Sequence[Any] | None = None) -> list[str]:
        """Each conversation's text, rendered with its template keywords (`kwargs[k]`, a mapping; consecutive
        conversations with the same mapping object, or none, in one call); a `ConversationError` when the template
        refuses one."""
        import jinja2

        kwargs = kwargs if kwargs is not None else [{}] * len(conversations)
        texts: list[str] = []
        start = 0
        while start < len(conversations):
            end = start + 1
            same = kwargs[start]
            while end < len(conversations) and (kwargs[end] is same or not (kwargs[end] or same)):
                end += 1
            try:
                rendered = self.tokenizer.apply_chat_template(
                    [list(c) for c in conversations[start:end]], tokenize=False, chat_template=self.template,
                    add_generation_prompt=add_generation_prompt, **same)
            except (jinja2.TemplateError, TypeError, KeyError, AttributeError, ValueError) as error:
                raise ConversationError("refused by the chat template", f"{type(error).__name__}: {error}") from None
            texts += [rendered] if isinstance(rendered, str) else list(rendered)
            start = end
        return texts

    def encode(self, texts: Sequence[str]) -> list[Any]:
        """Each text's encoding (`.ids`, `.offsets`: each token's character span) as `apply_chat_template`
        encodes its rendering: without special tokens added, truncation or padding, special tokens in the text
        read as such."""
        if not texts:
            return []
        if self.backend is not None:
            return self.backend.encode_batch(list(texts), add_special_tokens=False)
        fast = getattr(self.tokenizer, "is_fast", False)
        encoded = self.tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=fast,
                                 return_attention_mask=False, return_token_type_ids=False)
        offsets = encoded.get("offset_mapping") or [[]] * len(texts)
        return [_Encoding(ids, spans) for ids, spans in zip(encoded["input_ids"], offsets)]

    def ids_and_mask(self, conversation: Conversation, location: str = "") -> tuple[list[int], np.ndarray | None]:
        """One conversation's ids and mask; a `ConversationError` when the template refuses it or its trained turns
        cannot be located."""
        (encoded,) = self.encode_conversations([conversation], [location])
        if encoded.error is not None:
            raise encoded.error
        return encoded.ids, encoded.mask

    def encode_conversations(self, conversations: Sequence[Conversation],
                             locations: Sequence[str]) -> list[EncodedConversation]:
        """Each conversation's ids and mask; a conversation the template refuses, or whose trained turns cannot be
        located in its rendering, has its `ConversationError` in its entry."""
        kwargs = [c.template_kwargs for c in conversations]
        try:
            wholes = self.render([c.messages for c in conversations], False, kwargs)
        except ConversationError as error:
            return self._one_by_one(conversations, locations, error)
        if not self.settings.masked:
            return [EncodedConversation(encoding.ids, None) for encoding in self.encode(wholes)]
        cuts = [(n, i) for n, c in enumerate(conversations) for i in c.trained]
        inner = [(n, i) for n, i in cuts if i + 1 < len(conversations[n].messages)]  # the last ends with the whole
        try:
            starts = self._render_starts(conversations, cuts)
            ends = self.render([conversations[n].messages[: i + 1] for n, i in inner], False,
                               [kwargs[n] for n, _ in inner])
        except ConversationError as error:
            return self._one_by_one(conversations, locations, error)
        encoded = self.encode(wholes)
        ids = [encoding.ids for encoding in encoded]
        anchors = [self._anchors(text, whole, encoding) for text, whole, encoding in zip(wholes, ids, encoded)]
        start_ids = self._prefixes(wholes, ids, anchors, [n for n, _ in cuts], starts)
        inner_ids = iter(self._prefixes(wholes, ids, anchors, [n for n, _ in inner], ends))
        inner_texts = iter(ends)
        results = [EncodedConversation(whole, np.zeros(len(whole), dtype=np.uint8)) for whole in ids]
        for (n, i), start, start_text in zip(cuts, start_ids, starts):
            whole = results[n].ids
            last = i + 1 == len(conversations[n].messages)
            end, end_text = (whole, wholes[n]) if last else (next(inner_ids), next(inner_texts))
            if results[n].error is not None:
                continue
            if whole[: len(start)] == start and whole[: len(end)] == end:
                results[n].mask[len(start): len(end)] = 1
                continue
            try:
                self._mask_characters(results[n].mask, encoded[n], wholes[n], start_text, end_text, i,
                                      conversations[n].messages[i]["role"] == "assistant")
            except ConversationError as error:
                results[n] = EncodedConversation([], None, error)
        return results

    def _render_starts(self, conversations: Sequence[Conversation], cuts: Sequence[tuple[int, int]]) -> list[str]:
        """The rendering before each trained message: with the generation prompt before an assistant's (its
        header), without before any other role's (a message trained by its own flag: its header is trained)."""
        prompted = [conversations[n].messages[i]["role"] == "assistant" for n, i in cuts]
        texts: list[str] = [""] * len(cuts)  # nothing before a first message that opens without a prompt
        for generation in (True, False):
            chosen = [k for k, p in enumerate(prompted) if p == generation and (generation or cuts[k][1] > 0)]
            rendered = self.render([conversations[cuts[k][0]].messages[: cuts[k][1]] for k in chosen], generation,
                                   [conversations[cuts[k][0]].template_kwargs for k in chosen])
            for k, text in zip(chosen, rendered):
                texts[k] = text
        return texts

    def _mask_characters(self, mask: np.ndarray, encoding: Any, whole: str, start: str, end: str, index: int,
                         prompted: bool) -> None:
        """Mark the tokens whose characters overlap the span from the end of `start` to the end of `end` (both
        renderings of a prefix of `whole`); a `ConversationError` saying where they part from the whole when
        they are not prefixes of it, or when the tokenizer gives no character offsets."""
        prompted = " with the generation prompt" if prompted else ""
        for count, text, prompt in ((index, start, prompted), (index + 1, end, "")):
            if not whole.startswith(text):
                at = next((k for k, (a, b) in enumerate(zip(text, whole)) if a != b), min(len(text), len(whole)))
                raise ConversationError(
                    "turn not located in the rendering",
                    f"messages[{index}] is trained, but the template renders messages[:{count}]{prompt} as text that "
                    f"parts from the whole conversation's at character {at} ({whole[at: at + 40]!r} in the whole, "
                    f"{text[at: at + 40]!r} in the prefix): the template renders what comes before the turn otherwise "
                    "once more follows; --loss-on last trains the last turn only, --chat-documents turn each turn as "
                    "its own document, --loss-on all every token")
        offsets = np.asarray(getattr(encoding, "offsets", None) or [], dtype=np.int64).reshape(-1, 2)
        if len(offsets) != len(mask):
            raise ConversationError(
                "turn not located in the rendering",
                f"messages[{index}]: its first or last characters merge with the text around it into one token, and "
                "this tokenizer gives no character offsets to tell which tokens are its (a fast tokenizer does)")
        if len(end) > len(start):
            mask[(offsets[:, 0] < len(end)) & (offsets[:, 1] > len(start))] = 1

    def _one_by_one(self, conversations: Sequence[Conversation], locations: Sequence[str],
                    error: ConversationError) -> list[EncodedConversation]:
        """After the template refused one of a batch: each encoded alone, to find which (one alone: its error in its
        entry)."""
        if len(conversations) == 1:
            return [EncodedConversation([], None, error)]
        return [self.encode_conversations([conversation], [location])[0]
                for conversation, location in zip(conversations, locations, strict=True)]

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
