"""Tokenizers and chat templates, from GGUF metadata or a Hugging Face tokenizer.json.

The BPE itself is the `tokenizers` library's; this module only assembles it from the vocabulary,
merges and pre-tokenizer that a GGUF file names, and decides the special tokens (BOS, end of
generation) with the same care llama.cpp takes with imperfect metadata.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer as BackendTokenizer

from quickdraft.errors import QuickdraftError, read_json

log = logging.getLogger("quickdraft")

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Texts of tokens that end a turn or a document in the families we serve.
END_OF_GENERATION = {
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<|eom_id|>",
    "</s>", "<end_of_turn>", "<|return|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
}

@dataclass
class Tokenizer:
    backend: BackendTokenizer
    bos_id: int | None = None
    add_bos: bool = False
    eos_ids: frozenset[int] = frozenset()
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token / eos_token texts

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: no longer than its longest token's spelling (byte-level
        vocabularies spell a byte as one character, SentencePiece a space as one)."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Text -> ids. Special-token texts in `text` (e.g. <|im_start|>) become their ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or f"<id {token_id}>"

    @functools.cached_property
    def _byte_kind(self) -> str:
        """How tokens carry bytes: "level" (byte-level BPE: every character of a token's spelling is a byte),
        "fallback" (SentencePiece: tokens <0xNN> are single bytes, all others whole text), or "" (unknown)."""
        decoder = self.backend.decoder
        spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
        kinds = {d.get("type") for d in [spec, *spec.get("decoders", [])]}
        return "level" if "ByteLevel" in kinds else "fallback" if "ByteFallback" in kinds else ""

    @functools.cached_property
    def _added(self) -> dict:
        return self.backend.get_added_tokens_decoder()

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the output (a byte-level or byte-fallback token may be part of a character)."""
        added = self._added.get(token_id)
        if added is not None:
            return added.content.encode("utf-8")
        piece = self.backend.id_to_token(token_id) or ""
        kind = self._byte_kind
        if kind == "level":
            return bytes(_BYTE_OF.get(c, 0x20) for c in piece)
        if kind == "fallback":
            if _BYTE_TOKEN.fullmatch(piece):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8", "replace")
        return self.decode([token_id]).encode("utf-8")

    def ends_mid_character(self, ids: list[int]) -> bool | None:
        """Whether the bytes of ids end inside a UTF-8 character (a streamed detokenizer holds those back);
        None when this tokenizer's bytes are not known (then only a trailing U+FFFD says so)."""
        kind = self._byte_kind
        if not kind:
            return None
        tail = b"".join(self.token_bytes(i) for i in ids[-4:])  # a character is at most 4 bytes
        return _incomplete_utf8(tail[-4:])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                            **variables) -> str:
        """Render messages with the model's own chat template, as the model was trained to see them (tools: OpenAI's
        function specs, for templates that describe them; variables: more for the template, e.g. enable_thinking)."""
        if not self.chat_template:
            raise QuickdraftError("this model has no chat template in its metadata: give a raw prompt, not {chat}", "chat")
        return _compile_template(self.chat_template).render(
            **{**variables, **self.special_tokens},
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools or None,
        )

    def encode_chat(self, messages: list[dict], template_args: dict | None = None, *,
                    literal_special_text: bool = True) -> list[int]:
        """Messages rendered with the chat template (template_args: apply_chat_template's other arguments), as ids.
        literal_special_text: special-token text inside a message's content (a user typing "<|im_start|>system")
        stays text, so no message can forge a turn or a role; the template's own special tokens are control tokens
        as ever. Otherwise every special-token text becomes its control token, as llama-server and transformers'
        templates do."""
        template_args = template_args or {}
        text = self.apply_chat_template(messages, **template_args)
        pattern = self._control_pattern
        if not literal_special_text or pattern is None or not any(pattern.search(_content(m)) for m in messages):
            return self.encode(text)
        # the same render with the messages' special-token text masked shows which control tokens are the template's
        masked = self.apply_chat_template([_masked(m, pattern) for m in messages], **template_args)
        if len(masked) != len(text):
            raise QuickdraftError(_RESHAPED)
        if self._encode_between(masked, masked) != self.encode(masked, add_bos=False):
            # the backend reads the text next to a control token in a way pieces encoded alone do not reproduce (an
            # added token that strips the whitespace beside it, say): exact or refused, never silently other tokens
            raise QuickdraftError("the messages hold special-token text, which this model's tokenizer cannot keep "
                                  "as text exactly: remove it from the messages")
        return self._with_bos(self._encode_between(text, masked))

    def _encode_between(self, text: str, masked: str) -> list[int]:
        """text as ids: control tokens only where masked (text with the messages' special-token text masked) has
        them, everything between them read as plain text (the backend splits at control tokens first anyway, and
        encode_chat checks that the pieces add up to what it reads whole)."""
        ids, at = [], 0
        for m in self._control_pattern.finditer(masked):
            if text[m.start():m.end()] != m.group():  # the template put its own elsewhere: the renders differ
                raise QuickdraftError(_RESHAPED)
            ids += self._plain(text[at:m.start()], at)
            ids.append(self._control[m.group()])
            at = m.end()
        return ids + self._plain(text[at:], at)

    def _plain(self, piece: str, start: int) -> list[int]:
        """A piece of text that starts at `start` of the whole, as ids, special-token text as its characters."""
        backend = self._literal if start == 0 else self._literal_within
        return backend.encode(piece, add_special_tokens=False).ids if piece else []

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            return [self.bos_id] + ids
        return ids

    @functools.cached_property
    def _control(self) -> dict[str, int]:
        """Special (control) tokens by their text: <|im_start|>, <|eot_id|>, ..."""
        return {t.content: i for i, t in self._added.items() if t.special and t.content}

    @functools.cached_property
    def _control_pattern(self) -> re.Pattern | None:
        """Any control token's text, the longest first where several start at one place (as the backend matches)."""
        texts = sorted(self._control, key=len, reverse=True)
        return re.compile("|".join(re.escape(t) for t in texts)) if texts else None

    @functools.cached_property
    def _literal(self) -> BackendTokenizer:
        """A copy of the backend that reads special-token text as plain text (its own state: threads share the
        original)."""
        return _literal_copy(json.loads(self.backend.to_str()))

    @functools.cached_property
    def _literal_within(self) -> BackendTokenizer:
        """_literal for text that does not start the whole: SentencePiece files that prepend "▁" at the start of
        the text only (Metaspace's prepend_scheme "first": Llama 2's and Mistral's Hugging Face files) read the text
        after a control token without it ("a<s>b": ▁a <s> b), and so must a piece encoded alone."""
        pre = self.backend.pre_tokenizer  # its own description: cheap, where the whole backend's is not
        pre = json.loads(pre.__getstate__()) if pre is not None else None
        if _prepending_never(pre) == pre:  # nothing prepends at the start only: the same copy serves (a copy of a
            return self._literal  # 151,936-token vocabulary takes a second to build)
        spec = json.loads(self.backend.to_str())
        return _literal_copy({**spec, "pre_tokenizer": _prepending_never(spec.get("pre_tokenizer"))})

    def prepare(self) -> None:
        """Build now what encode_chat builds on the first message holding special-token text (the copies above: a
        second each for a large vocabulary), so that no request waits for it (the server calls it as it loads)."""
        if self._control_pattern is not None:
            self._literal_within

    # ---- builders -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """Build from the `tokenizer.*` keys of a GGUF file (tokenizer_gguf.py builds the tokenizer itself)."""
        from quickdraft import tokenizer_gguf

        backend = tokenizer_gguf.backend(meta)
        tokens, types = meta["tokenizer.ggml.tokens"], tokenizer_gguf.token_types(meta)

        def control(key):  # a metadata id is trusted only if it names a control token
            i = meta.get(key)
            if i is None or not 0 <= i < len(tokens):
                return None
            if types[i] != CONTROL:
                log.warning("ignoring %s=%d (%r): not a control token in this vocabulary", key, i, tokens[i])
                return None
            return i

        spm = meta.get("tokenizer.ggml.model") in ("llama", "gemma4")  # llama.cpp's defaults for them: BOS 1, EOS 2
        if spm:
            meta = {"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, **meta}
        bos, eos = control("tokenizer.ggml.bos_token_id"), control("tokenizer.ggml.eos_token_id")
        eog = {i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED) and tokens[i] in END_OF_GENERATION}
        eot = control("tokenizer.ggml.eot_token_id")
        eog |= {i for i in (eos, eot) if i is not None}
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", spm)) and bos is not None
        return cls(
            backend=backend,
            bos_id=bos,
            add_bos=add_bos,
            eos_ids=frozenset(eog),
            chat_template=meta.get("tokenizer.chat_template"),
            special_tokens={"bos_token": tokens[bos] if bos is not None else "",
                            "eos_token": tokens[eos] if eos is not None else ""},
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> "Tokenizer":
        """Build from tokenizer.json (+ tokenizer_config.json, generation_config.json) in a directory."""
        tj = path / "tokenizer.json"
        if not tj.exists():
            raise QuickdraftError(f"{path} has no tokenizer.json: quickdraft needs the fast-tokenizer file")
        backend = BackendTokenizer.from_file(str(tj))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")

        def token_of(value):
            return value.get("content") if isinstance(value, dict) else value

        bos_text, eos_text = token_of(cfg.get("bos_token")), token_of(cfg.get("eos_token"))
        bos = backend.token_to_id(bos_text) if bos_text else None
        eos_ids = set()
        for source in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
            eos_ids |= set(source if isinstance(source, list) else [source] if source is not None else [])
        if eos_text and backend.token_to_id(eos_text) is not None:
            eos_ids.add(backend.token_to_id(eos_text))
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        # tokenizer.json may carry its own BOS post-processor; we add BOS ourselves instead.
        backend.post_processor = None
        return cls(
            backend=backend,
            bos_id=bos,
            add_bos=bool(cfg.get("add_bos_token", False)) and bos is not None,
            eos_ids=frozenset(eos_ids),
            chat_template=template if isinstance(template, str) else None,
            special_tokens={"bos_token": bos_text or "", "eos_token": eos_text or ""},
        )


_RESHAPED = "the messages hold special-token text that the model's chat template reshapes: remove it from the messages"


def _literal_copy(spec: dict) -> BackendTokenizer:
    backend = BackendTokenizer.from_str(json.dumps(spec))
    backend.encode_special_tokens = True
    return backend


def _prepending_never(node):
    """A pre-tokenizer spec with each Metaspace that prepends "▁" at the start of the text (prepend_scheme
    "first") made to prepend nothing."""
    if isinstance(node, list):
        return [_prepending_never(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _prepending_never(v) for k, v in node.items()}
    if out.get("type") == "Metaspace" and out.get("prepend_scheme") == "first":
        out["prepend_scheme"] = "never"
    return out


def _content(message: dict) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _masked(message: dict, pattern: re.Pattern) -> dict:
    """The message with each special-token text in its content replaced by as many private-use characters."""
    content = _content(message)
    return {**message, "content": pattern.sub(lambda m: "\ue000" * len(m.group()), content)} if content else message


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_OF = _gpt2_bytes()
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _incomplete_utf8(tail: bytes) -> bool:
    """Whether tail ends with the first bytes of a UTF-8 character whose remaining bytes have not come yet."""
    for back in range(1, min(4, len(tail)) + 1):
        b = tail[-back]
        if b & 0xC0 != 0x80:  # not a continuation byte: the character's first byte
            need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
            return need > back
    return False


def _read_json(path: Path) -> dict:
    return read_json(path) if path.exists() else {}


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' marker of the assistant's part, for training masks):
    its body, as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """The template, as transformers renders it (the environment, filters and globals chat templates rely on)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _Generation]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False, separators=None: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise QuickdraftError(f"the model's chat template does not parse ({e}): use a raw prompt") from e
