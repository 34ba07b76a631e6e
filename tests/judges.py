"""A judge function with the ``judge_fn`` contract (``conversations -> replies``) whose replies come from
a fixed table: what the judge tests script. ``CALLS`` records how many messages each call asked."""

from __future__ import annotations

CALLS: list[int] = []
REPLIES = {"7": "Yes.", "8": "no", "6 or 7": "YES, the answer is there", "seven": "I cannot tell"}


def scripted(conversations: list[list[dict]]) -> list[str]:
    CALLS.append(len(conversations))
    return [REPLIES.get(conversation[-1]["content"].rsplit("Reply: ", 1)[-1], "no") for conversation in conversations]


def numeric(conversations: list[list[dict]]) -> list[str]:
    """A 1-10 judge: 9 for a reply of 7, 2 for anything else, and an unreadable reply for 'seven'."""
    CALLS.append(len(conversations))
    replies = []
    for conversation in conversations:
        completion = conversation[-1]["content"].rsplit("Reply: ", 1)[-1]
        replies.append({"7": "Score: 9/10", "seven": "eleven out of ten"}.get(completion, "2"))
    return replies


def lenient(conversations: list[list[dict]]) -> list[str]:
    """A judge that passes everything."""
    CALLS.append(len(conversations))
    return ["yes"] * len(conversations)


def unsure(conversations: list[list[dict]]) -> list[str]:
    """A judge whose every reply is off its scale."""
    CALLS.append(len(conversations))
    return ["I cannot tell"] * len(conversations)
