"""Tokenizer, chat template and streaming detokenizer, without transformers at run time.

``Tokenizer`` reads a checkpoint's tokenizer.json with the ``tokenizers`` library and its
chat template from tokenizer_config.json (or chat_template.jinja, where transformers >=
4.43 saves it) and renders the template the way transformers' ``apply_chat_template``
does: a sandboxed jinja2 environment with trim_blocks/lstrip_blocks, the loop-control
extension, a ``tojson`` that keeps non-ASCII text, ``raise_exception`` and
``strftime_now``, the special tokens (bos_token, eos_token, ...) as variables, message
keys whose value is None dropped, and the rendered text encoded without adding special
tokens again (the template writes them).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache

from flashtile._validate import _fail

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")


def _read_json(path):
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value):
    """A special token as tokenizer_config.json stores it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson escapes HTML characters, which chat templates must keep.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _find_chat_template(model_dir, config):
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    if template is None:
        path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                template = f.read()
        else:
            template = _read_json(os.path.join(model_dir, "chat_template.json")).get(
                "chat_template")
    return template


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: a file's path (its text), else the template itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:  # neither a file nor Jinja: most likely a mistyped path
        _fail(ValueError, "chat_template", "a Jinja template or the path of a file "
              "holding one", repr(value)[:80])
    return value


class Tokenizer:
    """tokenizer.json + tokenizer_config.json of a checkpoint directory."""

    def __init__(self, model_dir: str):
        from tokenizers import Tokenizer as HFTokenizer

        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            _fail(ValueError, "tokenizer", "a tokenizer.json in the model directory",
                  f"none in {model_dir!r}", "Pass prompts as token ids instead")
        self._tok = HFTokenizer.from_file(path)
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        self.special_tokens = {name: _token_text(config[name]) for name in SPECIAL_TOKENS
                               if config.get(name) is not None}
        self.chat_template = _find_chat_template(model_dir, config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self):
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self._tok.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def bad_words_ids(self, words) -> list[tuple[int, ...]]:
        """SamplingParams.bad_words as token id tuples, vLLM's way: each word as given
        and, where it does not start with a space, with one, if that gives the same
        number of tokens and another first one (the word after a space, mid-text)."""
        out = []
        for word in words:
            ids = tuple(self.encode(word, add_special_tokens=False))
            out.append(ids)
            if not word.startswith(" "):
                spaced = tuple(self.encode(" " + word, add_special_tokens=False))
                if len(spaced) == len(ids) and spaced[0] != ids[0]:
                    out.append(spaced)
        return out

    def convert_ids_to_tokens(self, token_ids) -> list:
        return [self._tok.id_to_token(i) for i in token_ids]

    def render_chat(self, messages, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    **kwargs) -> str:
        """The chat template's text for one conversation (a list of {"role", "content"}).
        continue_final_message (transformers' and vLLM's flag): the text ends inside the
        last message, for the model to continue it (say, an assistant reply begun by the
        caller); the template's closing of that message is cut off, found as
        transformers finds it, by a tag appended to the content. chat_template: this
        template instead of the model's."""
        chat_template = chat_template or self.chat_template
        if not chat_template:
            _fail(ValueError, "chat_template", "a chat template in tokenizer_config.json "
                  "or chat_template.jinja", "none", "Pass the prompt as text instead")
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, dict) for m in messages):
            _fail(TypeError, "messages", "a list of dicts with 'role' and 'content'",
                  type(messages).__name__)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if continue_final_message:
            if add_generation_prompt:
                _fail(ValueError, "continue_final_message", "add_generation_prompt=False "
                      "beside it (the last message is continued, not answered)",
                      "add_generation_prompt=True")
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str):
                _fail(ValueError, "continue_final_message", "a last message with text "
                      "content", repr(final)[:80])
            messages[-1] = {**messages[-1], "content": final + _CONTINUE_TAG}
        variables = {**self.special_tokens, **kwargs}
        text = _compile(chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if tag not in text:
                _fail(ValueError, "continue_final_message", "a chat template that writes "
                      "the last message's content", "one that leaves it out")
            at = text.rindex(tag)
            # A template that trims the content trims the tag's space: cut the
            # whitespace the trim left before it too (as transformers does).
            text = text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
        return text

    def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                            tokenize: bool = True, continue_final_message: bool = False,
                            **kwargs):
        """Token ids (or the text, tokenize=False) of the rendered conversation."""
        text = self.render_chat(messages, add_generation_prompt, continue_final_message,
                                **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


# continue_final_message's marker (transformers' own): appended to the last message's
# content, then the rendered text is cut where it appears.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class IncrementalDetokenizer:
    """Text of a growing list of output tokens, emitted piece by piece.

    Decoding each token alone breaks words split over several tokens (a multi-byte
    character, a SentencePiece space marker), and decoding everything each step is
    quadratic. So each step decodes a short window twice, from ``prefix_offset``: up to
    the tokens already emitted and up to the end; the difference is the new text. A
    window ending in U+FFFD is an incomplete character, kept until it completes.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids, skip_special_tokens=True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids)
        # A few prompt tokens as left context, so the first output token's leading space
        # is decoded as it would be mid-text.
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - 5, 0)
        self.text = ""

    def add(self, token_ids, final: bool = False) -> str:
        """Append tokens; return the text they complete (possibly "").

        final: no token follows (the request finished), so an incomplete character at
        the end will never complete: it is emitted as decode gives it (U+FFFD), and the
        text is the decode of all the tokens, as transformers' decode returns it.
        """
        self.ids.extend(token_ids)
        before = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset],
                                       self.skip)
        after = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        new = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new
