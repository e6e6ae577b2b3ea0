"""prl_reverse_text: reverse a short string, character by character.

A verifiers (v1) environment for small instruction models (the SmolLM2-135M
recipe): the prompt gives one to three common words, the reply should be the
text reversed. The reward is the LCS ratio between the reply and the reversed
text, 2 * LCS / (len(reply) + len(target)), so partial reversals earn partial
credit; `exact` is reported as a metric. The train and eval splits are
generated from different seeds and the eval split drops any text the train
split contains.

    {"taskset": {"id": "prl_reverse_text", "split": "eval", "num_examples": 64}}

Fully offline: the texts are generated from a built-in word list.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf
from verifiers.v1.types import content_text

__all__ = ["ReverseTextTaskset", "ReverseTextTask", "ReverseTextData", "ReverseTextConfig", "lcs_ratio", "last_reply"]

_WORDS = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city name "
    "team minute idea kid body back parent face others level office door health art "
    "war history party result change morning reason research girl guy moment air "
    "teacher force education foot boy age policy music market sense nation plan "
    "college interest death experience effect class control care field development "
    "role effort rate heart drug show leader light voice wife police mind price "
    "report decision son view relationship town road arm difference value building "
    "action model season society tax director position player record paper space "
    "ground form event official matter center couple site project activity star table "
    "need court oil situation cost industry figure street image phone data picture "
    "practice piece land product doctor wall patient worker news test movie north love"
).split()

PROMPT = "Reverse the following text character by character. Reply with the reversed text only.\n\nText: {text}"


class ReverseTextConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    """Which split to load (disjoint texts)."""
    num_examples: int | None = None
    """Tasks to generate; default 2000 (train) or 100 (eval)."""
    max_words: int = 3
    """Words per text: 1..max_words."""
    seed: int = 0


class ReverseTextData(vf.TaskData):
    text: str
    """The text to reverse (the answer is text[::-1])."""


def last_reply(trace: vf.Trace) -> str:
    """Text of the model's last reply in the trace ('' if it never answered)."""
    replies = trace.assistant_messages
    return content_text(replies[-1].content) if replies else ""


def lcs_ratio(a: str, b: str) -> float:
    """2 * len(longest common subsequence) / (len(a) + len(b)); 1.0 for two empty strings."""
    if not a and not b:
        return 1.0
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return 2.0 * prev[-1] / (len(a) + len(b))


class ReverseTextTask(vf.Task[ReverseTextData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def lcs(self, trace: vf.Trace) -> float:
        return lcs_ratio(last_reply(trace).strip(), self.data.text[::-1])

    @vf.metric
    async def exact(self, trace: vf.Trace) -> float:
        return float(last_reply(trace).strip() == self.data.text[::-1])


def _texts(seed: str, n: int, max_words: int, exclude: set[str] = frozenset()) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(n * 50):
        if len(out) == n:
            break
        text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, max(1, max_words))))
        if text not in exclude:
            out.append(text)
    return out


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self) -> Iterator[ReverseTextTask]:
        cfg = self.config
        n_train = cfg.num_examples if cfg.split == "train" and cfg.num_examples is not None else 2000
        train = _texts(f"{cfg.seed}-train", n_train, cfg.max_words)
        if cfg.split == "train":
            texts = train
        else:
            n_eval = cfg.num_examples if cfg.num_examples is not None else 100
            texts = _texts(f"{cfg.seed}-eval", n_eval, cfg.max_words, exclude=set(train))
        for i, text in enumerate(texts):
            yield ReverseTextTask(
                ReverseTextData(id=f"{cfg.split}-{i}", prompt=PROMPT.format(text=text), text=text), cfg.task
            )
