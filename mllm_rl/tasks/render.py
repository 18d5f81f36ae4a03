"""A prompt as the model sees it: through the tokenizer's chat template (``--chat-template auto``,
when the checkpoint has one and the task's prompts are chat prompts; a list of ``{role, content}``
messages needs one), or as it is. ``check_lengths`` refuses a prompt that does not fit."""

from __future__ import annotations

from typing import Any

CHAT_TEMPLATE = ("auto", "off")


def uses_template(tok: Any, templated: bool, mode: str) -> bool:
    return templated and mode == "auto" and bool(getattr(tok, "chat_template", None))


def render(tok: Any, prompt: Any, templated: bool, mode: str, where: str = "") -> str:
    """The text the model is given for ``prompt``; ``ValueError`` for messages without a template."""
    if isinstance(prompt, str):
        if not uses_template(tok, templated, mode):
            return prompt
        messages = [{"role": "user", "content": prompt}]
    else:
        if not uses_template(tok, True, mode):
            why = (
                "--chat-template off" if mode == "off" else "the checkpoint's tokenizer has no chat template"
            )
            raise ValueError(f"{where or 'a prompt'}: a list of messages needs a chat template ({why})")
        messages = prompt
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_all(tok: Any, examples: list[Any], templated: bool, mode: str) -> list[str]:
    return [render(tok, e.prompt, templated, mode, e.where) for e in examples]


def token_ids(tok: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of rendered prompts; quiet, as ``check_lengths`` names a prompt that is too long."""
    if not texts:
        return []
    return [list(ids) for ids in tok(texts, add_special_tokens=False, verbose=False).input_ids]


def check_lengths(
    tok: Any, examples: list[Any], templated: bool, mode: str, max_new_tokens: int, allowed: int, why: str
) -> int:
    """The longest prompt's tokens; ``ValueError`` naming the first row whose prompt plus
    ``max_new_tokens`` (and one token of slack, as the engine is sized) exceeds ``allowed``."""
    longest = 0
    for start in range(0, len(examples), 1024):
        chunk = examples[start : start + 1024]
        lens = [len(ids) for ids in token_ids(tok, render_all(tok, chunk, templated, mode))]
        for e, n in zip(chunk, lens, strict=True):
            need = n + max_new_tokens + 1
            if need > allowed:
                raise ValueError(
                    f"{e.where or 'a prompt'}: the prompt is {n} tokens; with --max-new-tokens "
                    f"{max_new_tokens} it needs a context of {need}, and the run allows {allowed} ({why})"
                )
        longest = max(longest, *lens)
    return longest
