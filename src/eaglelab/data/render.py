"""Conversations -> token ids in the target's chat template: the data stage's first step (eaglelab.data.prepare_set),
before any engine runs. A prompt that leaves no room for a response is skipped. A multi-turn conversation answered
turn by turn (`turns="all"`) is kept when its first round fits; the rounds that follow are rendered as the target
answers them (eaglelab.data.turns), and the longest its last prompt can be sizes and sorts it. A prompt that ends
with an assistant turn (`data.responses=original`) keeps that turn, within its budget, as its response."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from eaglelab.core.errors import DataError
from eaglelab.data.cache_entry import CaptureSettings, SetRequest
from eaglelab.data.prompts import Messages, question
from eaglelab.data.regenerate import response_budget, stop_ids
from eaglelab.data.templates import template_prompt, template_response
from eaglelab.data.turns import history, is_multi_turn, longest_prompt, original_turns, rounds

log = logging.getLogger("eaglelab")


@dataclass
class Rendered:
    """The kept prompts of a set, each in the target's template, in the set's order."""

    templated: list[np.ndarray] = field(default_factory=list)  # int32 ids (a Python list of ids holds ~9x the bytes)
    is_val: list[bool] = field(default_factory=list)  # a validation prompt (never trained on)
    rows: list[int] = field(default_factory=list)  # each kept prompt's position in `prompts`
    multi: list[bool] = field(default_factory=list)  # answered turn by turn
    sizes: list[int] = field(default_factory=list)  # what sorts it: its prompt's length (the longest it can grow to)
    spans: list[list] = field(default_factory=list)  # the source's earlier assistant turns (original multi-turn)
    originals: list[list[int]] = field(default_factory=list)  # the sources' own responses, when they have them
    stops: list[int] = field(default_factory=list)  # the target's stop ids (they determine the sequences too)
    skipped: int = 0  # prompts that leave no room for a response
    prompts: Sequence[Messages] = ()  # what was rendered, read from its source again where a conversation is needed

    @property
    def conversations(self) -> Sequence[Messages]:
        """Each kept prompt's question (the messages before any answer), read when asked for: the set holds its ids,
        not its text."""
        return Questions(self.prompts, self.rows)

    def conversations_where(self, chosen: list[bool]) -> Sequence[Messages]:
        """The questions of the kept prompts where `chosen` (one flag a kept prompt), read when asked for."""
        return Questions(self.prompts, [row for row, c in zip(self.rows, chosen, strict=True) if c])

    @property
    def turned(self) -> list[Messages] | None:
        """The conversations the target answers turn by turn (None: one turn each, or the sources' own answers)."""
        return self.conversations if any(self.multi) and not self.originals else None


class Questions(Sequence):
    """The questions of the prompts at `rows` (a prompt that ends with its source's answer: without it)."""

    def __init__(self, prompts: Sequence[Messages], rows: list[int]):
        self.prompts, self.rows = prompts, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, j: int) -> Messages:
        return question(self.prompts[self.rows[j]])


def render_prompts(
    target, prompts: Sequence[Messages], request: SetRequest, how: CaptureSettings, limit: int
) -> Rendered:
    """`prompts` in the target's template (`request.render(tokenizer, messages) -> ids` instead, for the suites'
    templates); `limit`: the longest a sequence may be."""
    name, render, max_new_tokens = request.name, request.render, request.max_new_tokens
    system_prompt, is_val, turns = how.system_prompt, request.is_val, request.turns
    out = Rendered(stops=sorted(stop_ids(target)), prompts=prompts)
    chat = lambda m: template_prompt(target.tokenizer, m, system_prompt)  # noqa: E731
    respond = lambda m, ids: template_response(target.tokenizer, m, system_prompt, ids, set(out.stops))  # noqa: E731
    for row, (messages, validation) in enumerate(zip(prompts, is_val or [False] * len(prompts), strict=True)):
        asked = question(messages)
        every_turn = turns == "all" and render is None and is_multi_turn(asked)
        if every_turn and asked is not messages:  # the source's turns, each a span
            said = original_turns(messages, chat, respond)
            ids, size = said.prompt, len(said.prompt)
        elif every_turn:
            ids, size = chat(history(asked, rounds(asked)[0], [])), longest_prompt(asked, chat, max_new_tokens)
        else:
            ids = render(target.tokenizer, asked) if render else chat(asked)
            size = len(ids)
        if len(ids) + 8 > limit:
            out.skipped += 1
            continue
        out.templated.append(np.asarray(ids, np.int32))
        out.is_val.append(validation)
        out.rows.append(row)
        out.multi.append(every_turn)
        out.sizes.append(size)
        out.spans.append(said.spans if every_turn and asked is not messages else [])
        if asked is not messages:
            answer = said.response if every_turn else respond(messages, ids)
            out.originals.append(answer[: response_budget(len(ids), max_new_tokens, limit)])
    if out.originals and len(out.originals) != len(out.templated):
        raise DataError(f"{name}: some prompts end with an assistant turn and some do not; use one kind of source")
    if out.skipped:
        log.warning("%s: skipped %d of %d prompts longer than the context (%d tokens)", name, out.skipped,
                    len(prompts), limit)  # fmt: skip
    if not out.templated:
        raise DataError(
            f"{name}: the dataset is empty after filtering ({len(prompts)} prompts, {out.skipped} longer than "
            f"{limit} tokens); raise data.max_length or give more/shorter prompts"
        )
    return out
