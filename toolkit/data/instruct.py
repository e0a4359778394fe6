"""Instruction tuning data: conversations (data.format chat) or prompts with their responses (prompt-response),
tokenized with labels that carry the loss on the response tokens only; every other position, the prompt, the
user's turns, the template's markup and padding, is IGNORE_INDEX. The loop's loss is then the mean over the
response tokens of the global batch (toolkit/data/losses.py counts the labels that are not ignored).

Which tokens are the response is decided on the text, not on token ids: the responses' character spans in the
rendered text (for a chat, what the template adds between the conversation so far with a generation prompt
and the conversation with that assistant turn), then each token whose characters overlap a span. A
tokenizer merges across a prompt/response boundary as it likes; the offsets say where each token came from. A
token that begins in the prompt and ends in the response is the response's: byte-level BPE (Llama-3, Qwen) and
SentencePiece merge a prompt's trailing space with the answer's first word (" yes", "▁yes"), and that word is
what the model must learn to write.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from toolkit.config.recipe import DataConfig
from toolkit.data.losses import IGNORE_INDEX
from toolkit.errors import RecipeError

Span = tuple[int, int]  # [start, end) characters of a response in the rendered text


def prompt_response_text(prompt: str, response: str, tokenizer) -> tuple[str, list[Span]]:
    """The sample's text (the response ends with the tokenizer's end-of-sequence token, when it has one, so
    that the model learns to stop) and the response's span."""
    tail = response + (tokenizer.eos_token or "")
    return prompt + tail, [(len(prompt), len(prompt) + len(tail))]


def chat_text(messages: list[dict], tokenizer, template: str | None) -> tuple[str, list[Span]]:
    """The rendered conversation and the span of each assistant turn in it."""
    def render(part: list[dict], generation: bool) -> str:
        try:
            return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=generation,
                                                 chat_template=template)
        except Exception as exc:  # a template is code the user gave: whatever it raises is theirs to fix
            whose, fix = ("data.chat_template", "fix it") if template is not None else \
                ("the tokenizer's chat template", "set data.chat_template to one that renders it")
            reason = (str(exc).strip().splitlines() or [""])[0][:200]
            raise RecipeError(f"data.format chat: {whose} fails on a conversation ({type(exc).__name__}: "
                              f"{reason}); {fix}") from None

    full = render(messages, False)
    spans = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, through = render(messages[:index], True), render(messages[:index + 1], False)
        if not (through.startswith(before) and full.startswith(through)):
            raise RecipeError("data.format chat: the chat template renders a conversation so that its beginning "
                              "changes as turns are added, so the assistant's tokens cannot be told apart; set "
                              "data.chat_template to a template that appends each turn")
        spans.append((len(before), len(through)))
    return full, spans


def encode(texts: list[str], spans: list[list[Span]], tokenizer, *, max_length: int | None,
           add_special_tokens: bool) -> dict[str, list]:
    """input_ids and labels: a token's label is itself where its text overlaps a response span, else
    IGNORE_INDEX (special tokens the tokenizer adds have no text: ignored). Each sample is cut at `max_length`
    (None: kept whole, for packing); num_cut says how many tokens that cut off."""
    out = tokenizer(texts, truncation=max_length is not None, max_length=max_length, return_offsets_mapping=True,
                    add_special_tokens=add_special_tokens)
    labels = []
    for ids, offsets, sample_spans in zip(out["input_ids"], out["offset_mapping"], spans):
        labels.append([token if end > start and any(start < b and end > a for a, b in sample_spans) else
                       IGNORE_INDEX for token, (start, end) in zip(ids, offsets)])
    return {"input_ids": out["input_ids"], "labels": labels,
            "num_cut": num_cut_tokens(texts, out["input_ids"], tokenizer, max_length=max_length,
                                      add_special_tokens=add_special_tokens)}


def num_cut_tokens(texts: list[str], ids: list[list[int]], tokenizer, *, max_length: int | None,
                   add_special_tokens: bool = True) -> list[int]:
    """How many tokens truncation at `max_length` cut off each text. Only a sample that fills max_length may
    have been cut: those alone are tokenized again, whole, to count (a data set of short texts costs nothing)."""
    cut = [0] * len(texts)
    if max_length is None:
        return cut
    full = [i for i, row in enumerate(ids) if len(row) >= max_length]
    if full:
        whole = tokenizer([texts[i] for i in full], add_special_tokens=add_special_tokens)["input_ids"]
        for i, row in zip(full, whole):
            cut[i] = max(0, len(row) - len(ids[i]))
    return cut


def encode_batch(batch: dict, data: DataConfig, tokenizer, *, indices: list[int], where: str) -> dict[str, list]:
    """A `datasets.map` batch of instruction rows (`indices`: their positions in the split, from 0; `where`: the
    split's key and path, "data.eval: FILE") -> input_ids, labels and num_cut (whole samples under data.packing:
    the packer cuts the stream into blocks)."""
    if data.format == "chat":
        rendered = []
        for index, messages in zip(indices, batch[data.messages_column]):
            try:
                rendered.append(chat_text(messages, tokenizer, data.chat_template))
            except RecipeError as exc:  # the template fails on this conversation: say which, as other data errors do
                reason = str(exc).removeprefix("data.format chat: ").replace("on a conversation", "on its "
                                                                            "conversation", 1)
                raise RecipeError(f"{where} row {index + 1}: {reason}") from None
        special = False  # the template writes the conversation's special tokens itself
    else:
        rendered = [prompt_response_text(p, r, tokenizer)
                    for p, r in zip(batch[data.prompt_column], batch[data.response_column])]
        special = True
    return encode([text for text, _ in rendered], [spans for _, spans in rendered], tokenizer,
                  max_length=None if data.packing else data.max_length, add_special_tokens=special)


def check_tokenizer(data: DataConfig, tokenizer) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise RecipeError(f"data.format {data.format} needs a fast tokenizer (its offsets tell response tokens "
                          "apart); give a tokenizer folder with tokenizer.json")
    if data.format == "chat" and data.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise RecipeError("data.format chat: the tokenizer has no chat template; set data.chat_template to one "
                          "(a Jinja template over `messages`, as in tokenizer_config.json)")
    if data.format == "chat":  # a template that does not parse, or fails on a plain exchange: found before training
        text, spans = chat_text([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                                tokenizer, data.chat_template)
        if not any("hello" in text[start:end] for start, end in spans):  # nothing of the response to train on
            whose = "data.chat_template" if data.chat_template is not None else "the tokenizer's chat template"
            raise RecipeError(f"data.format chat: {whose} does not write the assistant's message (rendered "
                              f"{text[:60]!r} for user 'hi', assistant 'hello'); it must write each message's "
                              "content ({{ message['content'] }})")


def chat_template_text(data: DataConfig) -> DataConfig:
    """`data` with data.chat_template as template text: a value that holds no Jinja tag ({{ }}, {% %}) is not a
    template but the path of a file holding one (a .jinja file, as most templates are kept), which is read."""
    template = data.chat_template
    if template is None or data.format != "chat" or "{{" in template or "{%" in template:
        return data
    path = Path(template).expanduser()
    if not path.is_file():  # a path is shown whole (a test's folder is over 100 characters), long text cut
        raise RecipeError(f"data.chat_template {template[:240]!r} is neither a Jinja template (it has no {{{{ }}}} "
                          "or {% %}) nor a file; give the template's text or the path of a file holding it")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"data.chat_template: {path} cannot be read ({type(exc).__name__}); fix the "
                          "file") from None
    return replace(data, chat_template=text)


def adopt_chat_template(tokenizer, data: DataConfig) -> None:
    """data.chat_template, when given, becomes the tokenizer's own. The run saves this tokenizer with its
    checkpoints (hf/) and its export: a model is prompted through its tokenizer's template (apply_chat_template,
    serving stacks), and the tokenizer's original one, or none, renders another format than it was trained on."""
    template = chat_template_text(data).chat_template
    if data.format == "chat" and template is not None:
        tokenizer.chat_template = template


def check_messages(rows, key: str, path, column: str) -> None:
    """Each row of `column` is a list of {role, content} turns with at least one assistant turn."""
    for number, messages in enumerate(rows, start=1):
        ok = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)
        if not ok:
            raise RecipeError(f"{key}: {path} row {number}: {column!r} must be a list of {{role, content}} "
                              f"messages, got {str(messages)[:80]!r}; fix the data or set data.messages_column")
        if not any(m["role"] == "assistant" for m in messages):
            raise RecipeError(f"{key}: {path} row {number} has no assistant message: nothing to train on; add "
                              "one or drop the row")
        if messages[0]["role"] == "assistant":  # chat_text renders what precedes each assistant turn
            raise RecipeError(f"{key}: {path} row {number} starts with an assistant message: a chat template "
                              "renders no empty conversation to tell its tokens apart; begin with a user or system "
                              "message")
