"""Multi-turn conversations: every assistant turn trained, each the target's own (`data.turns=all`).

A conversation from a JSONL/HF source answers several user turns. With `data.responses=regenerate` the target
answers them turn by turn, as a chat server sees the conversation: round k's prompt is the chat template over the
history so far (system and user turns, and the target's own earlier answers as text, replacing the source's), and
the target answers it greedily, up to a stop id or its budget. The training sequence is the last round's prompt
followed by its answer; the earlier answers lie inside that prompt, at the spans `locate` finds: where the template
put each answer, the tokens the target generated there (cut at the first token a re-tokenisation of its text
changed, so no span holds a token the target did not emit). Losses cover every span (eaglelab.train.batches.Batch).

`data.responses=original` keeps the source's assistant turns throughout, each a span. `data.turns=last` trains
the last answer only, the earlier turns context in the source's words (what eaglelab did before turns existed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from eaglelab.data.prompts import Messages


class Conversation(NamedTuple):
    """A conversation's training sequence: prompt + response, its tail, and its earlier assistant turns."""

    prompt: list[int]  # the last round's prompt: the whole history, in the chat template
    response: list[int]  # the last answer
    tail: list[int]  # the greedy continuation past the last answer (validation's simulated acceptance)
    spans: list[tuple[int, int]]  # earlier answers inside `prompt`: [start, end) each, in order
    rounds: int  # user turns answered (rounds that fit the context)


def _answered(messages: Messages) -> list[int]:
    """Indices of the user turns the source answers (an assistant turn follows)."""
    return [
        i for i in range(len(messages) - 1) if messages[i]["role"] == "user" and messages[i + 1]["role"] == "assistant"
    ]


def rounds(messages: Messages) -> list[int]:
    """Indices of the user turns a conversation answers: each user turn the source answers before its last user
    turn, and the last one."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return [i for i in _answered(messages) if i < last] + [last]


def is_multi_turn(messages: Messages) -> bool:
    return len(rounds(messages)) > 1


TURN_TOKENS = 16  # what a chat template writes around one assistant turn (its markers and newlines), with room


def longest_prompt(messages: Messages, render: Callable[[Messages], list[int]], max_new_tokens: int) -> int:
    """At most how many tokens a conversation's last round's prompt holds when the target answers it turn by turn:
    its system and user turns as the template renders them, and each earlier answer at its full budget (what sizes
    its sequence for the memory and disk checks, whatever the source's own answers' length)."""
    asked = rounds(messages)
    return len(render(history(messages, asked[-1], []))) + (len(asked) - 1) * (max_new_tokens + TURN_TOKENS)


def history(messages: Messages, upto: int, answers: list[str]) -> Messages:
    """The conversation up to user turn `upto` with the answer to each earlier answered user turn replaced by
    `answers` (in order); the source's other assistant turns are dropped (they are not the target's words)."""
    answered = {i + 1: k for k, i in enumerate(_answered(messages))}  # assistant index -> its answer
    out = []
    for i, m in enumerate(messages[: upto + 1]):
        if m["role"] != "assistant":
            out.append(m)
        elif i in answered and answered[i] < len(answers):
            out.append({"role": "assistant", "content": answers[answered[i]]})
    return out


def locate(prompt: list[int], earlier: list[tuple[list[int], list[int]]]) -> list[tuple[int, int]]:
    """Where each earlier (round prompt, answer) lies in the last round's `prompt`: the answer starts where its
    round's prompt ends (when that prompt is a prefix: templates render earlier turns as before) and runs as long
    as the tokens agree with the answer's own. Turns that cannot be found are left out (not trained)."""
    spans = []
    for round_prompt, answer in earlier:
        start = len(round_prompt)
        if prompt[:start] != round_prompt:
            continue
        n = 0
        while n < len(answer) and start + n < len(prompt) and prompt[start + n] == answer[n]:
            n += 1
        if n:
            spans.append((start, start + n))
    return spans


def regenerate_turns(
    conversations: list[Messages],
    render: Callable[[Messages], list[int]],
    generate: Callable[[list[list[int]]], list[tuple[list[int], list[int]]]],
    decode: Callable[[list[int]], str],
    limit: int,
) -> list[Conversation]:
    """Every conversation answered round by round by the target: `render(messages) -> prompt ids` (the chat
    template), `generate(prompts) -> [(response, tail)]` (greedy, the caller's budgets: both backends'),
    `decode(response) -> text` (the answer as the next round's history holds it). A round whose prompt leaves no
    room for an answer within `limit` tokens ends the conversation at the round before (the first round always
    fits: the caller skipped those that do not)."""
    turns = [rounds(c) for c in conversations]
    asked: list[list[list[int]]] = [[] for _ in conversations]  # per conversation: each round's prompt
    answered: list[list[tuple[list[int], list[int]]]] = [[] for _ in conversations]  # (response, tail) each
    texts: list[list[str]] = [[] for _ in conversations]
    for k in range(max(map(len, turns), default=0)):
        todo, prompts = [], []
        for i, conversation in enumerate(conversations):
            if k >= len(turns[i]) or len(answered[i]) < k:  # no such round, or ended at an earlier one
                continue
            ids = render(history(conversation, turns[i][k], texts[i]))
            if k and len(ids) + 8 > limit:
                continue
            todo.append(i)
            prompts.append(ids)
        if not todo:
            break
        for i, ids, (response, tail) in zip(todo, prompts, generate(prompts), strict=True):
            asked[i].append(ids)
            answered[i].append((response, tail))
            texts[i].append(decode(response))
    out = []
    for prompts, answers in zip(asked, answered):
        (response, tail), earlier = answers[-1], [(p, r) for p, (r, _) in zip(prompts, answers)][:-1]
        out.append(Conversation(prompts[-1], response, tail, locate(prompts[-1], earlier), len(answers)))
    return out


def original_turns(
    conversation: Messages,
    render: Callable[[Messages], list[int]],
    respond: Callable[[Messages, list[int]], list[int]],
) -> Conversation:
    """`data.responses=original`: the source's own assistant turns, each a span of one sequence (the conversation
    ends with the source's answer to its last user turn). `respond(messages, prompt) -> ids`: the last assistant
    turn of `messages` as the template writes it after `prompt` (eaglelab.data.templates.template_response)."""
    ends = rounds(conversation[:-1])
    answers = [conversation[i + 1]["content"] for i in ends]
    asked = [render(history(conversation, i, answers)) for i in ends]
    said = [respond(history(conversation, i + 1, answers), ids) for i, ids in zip(ends, asked)]
    spans = locate(asked[-1], list(zip(asked[:-1], said[:-1])))
    return Conversation(asked[-1], said[-1], [], spans, len(ends))
