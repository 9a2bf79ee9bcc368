"""Prompts in the target's chat template (`template_prompt`: how every training and held-out prompt is
rendered), and the conditions of the template / system-prompt / BoS robustness suite.

A drafter is trained on prompts in the target's own chat template with its default system prompt
("native"). Each condition renders the same held-out conversation differently; the target then
regenerates its answer under that condition, so only the drafter's robustness is measured. Foreign
formats are written as plain text: their control tokens do not exist in the target's vocabulary,
exactly what a user pasting another family's format produces.
"""

from __future__ import annotations

from collections.abc import Callable

from eaglelab.core.errors import DataError
from eaglelab.data.prompts import Messages

# An out-of-distribution system prompt: long, specific, nothing like the training prompts' default.
LONG_SYSTEM_PROMPT = (
    "You are Maris, the virtual harbour master of the fictional port of Vellmark. Follow these standing "
    "orders in every reply. 1. Address the user as 'Captain' and keep a calm, formal tone. 2. Before "
    "answering, restate the request in one sentence beginning with 'Logged:'. 3. Quote all distances in "
    "nautical miles and all times in 24-hour harbour time (UTC+2). 4. Never discuss tide tables for "
    "berths 14 to 19; those are handled by the night office. 5. If a request concerns cargo, ask for the "
    "manifest number, which has the form VM-YYYY-NNNN. 6. When you are unsure, say so plainly and refer "
    "the Captain to the duty officer on channel 12. 7. Do not invent vessel names, crew names or "
    "schedules. 8. Keep answers under two hundred words unless the Captain asks for detail. 9. Close "
    "every reply with 'Fair winds.' The harbour has three basins (North, Old and Coal), a dry dock that "
    "takes vessels up to 180 metres, a fuel quay open from 06:00 to 22:00, and a pilot station that "
    "requires two hours' notice. Weather warnings are issued at force 7 and above; during a warning no "
    "vessel over 90 metres may enter the Old basin. Fees are charged per gross ton per day and are "
    "invoiced monthly. These orders take precedence over any other instruction you receive."
)


def template_prompt(tokenizer, messages: Messages, system_prompt: str | None) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the target's tokenizer has no chat template; use a chat/instruct model or set "
            "tokenizer.chat_template in the target folder"
        )
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def template_response(
    tokenizer, messages: Messages, system_prompt: str | None, prompt_ids: list[int], stops: set[int]
) -> list[int]:
    """The ids of a conversation's last (assistant) turn as the chat template writes it after `prompt_ids`, up to
    and with its first stop id (where the target would end its turn)."""
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    if isinstance(full, dict) or hasattr(full, "input_ids"):
        full = full["input_ids"]
    full = list(full)
    if full[: len(prompt_ids)] == prompt_ids:
        answer = full[len(prompt_ids) :]
    else:  # a template that renders a turn differently once answered: the text itself, closed by a stop id
        answer = [*tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"], min(stops)]
    end = next((i for i, t in enumerate(answer) if t in stops), None)
    return answer if end is None else answer[: end + 1]


def _user_text(messages: Messages) -> str:
    return "\n\n".join(m["content"] for m in messages if m["role"] == "user")


def _plain(tokenizer, text: str) -> list[int]:
    # split_special_tokens: "<s>" or "<|begin_of_text|>" stay text even where they exist as control tokens
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _native(tokenizer, messages, system_prompt):
    return template_prompt(tokenizer, messages, system_prompt)


def _no_template(tokenizer, messages, system_prompt):
    return list(tokenizer(_user_text(messages))["input_ids"])  # the tokenizer's own special tokens only


def _foreign_llama3(tokenizer, messages, system_prompt):
    return _plain(
        tokenizer,
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
        f"{_user_text(messages)}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    )


def _foreign_mistral(tokenizer, messages, system_prompt):
    return _plain(tokenizer, f"<s>[INST] {_user_text(messages)} [/INST]")


def _bos_on(tokenizer, messages, system_prompt):
    ids, bos = _native(tokenizer, messages, system_prompt), tokenizer.bos_token_id
    return ids if bos is None or ids[:1] == [bos] else [bos, *ids]


def _bos_off(tokenizer, messages, system_prompt):
    ids, bos = _native(tokenizer, messages, system_prompt), tokenizer.bos_token_id
    return ids[1:] if bos is not None and ids[:1] == [bos] else ids


def _system_empty(tokenizer, messages, system_prompt):
    # An explicit empty system turn: the nearest a template that injects a default system prompt
    # (SmolLM2's does) can come to "no system prompt".
    return template_prompt(tokenizer, messages, "")


def _system_long(tokenizer, messages, system_prompt):
    return template_prompt(tokenizer, messages, LONG_SYSTEM_PROMPT)


Render = Callable[[object, Messages, "str | None"], list[int]]
CONDITIONS: dict[str, tuple[Render, str]] = {
    "native": (_native, "the target's chat template, training's system prompt"),
    "no_template": (_no_template, "the user text only, no chat template"),
    "foreign_llama3": (_foreign_llama3, "Llama-3 chat format written as text"),
    "foreign_mistral": (_foreign_mistral, "Mistral [INST] format written as text"),
    "bos_on": (_bos_on, "native with the tokenizer's BoS token first"),
    "bos_off": (_bos_off, "native without a leading BoS token (SmolLM2: its BoS is the first turn's <|im_start|>)"),
    "system_empty": (_system_empty, "chat template with an empty system turn"),
    "system_long": (_system_long, "chat template with a long out-of-distribution system prompt"),
}


def renderer(condition: str, system_prompt: str | None) -> Callable[[object, Messages], list[int]]:
    """(tokenizer, messages) -> prompt token ids under `condition`."""
    render = CONDITIONS[condition][0]
    return lambda tokenizer, messages: render(tokenizer, messages, system_prompt)
