"""A recorded target: an ``EngineTarget`` whose rows are recorded outputs, its calls priced by the measured t(n).

Replay (``bench.replay``) runs the real ``Engine``, drafters and k policies over it, so a replayed
step is budgeted, drafted, cut, verified and committed by the very code a live run uses.  At
temperature 0 the target's token after a context is a function of that context, and a bench run
records it: for a recorded request, the target's argmax after ``prompt + output[:i]`` is
``output[i]``.  ``decode`` therefore answers each row with that token (``PredictedRows``: the argmax
without a vocabulary-wide row), and costs what the run's target would have spent: the calls its
``decode`` makes (``batching.decode_calls``: split at ``max_rows``, padded to ``min_rows`` or
``pad_to``), each priced at t(rows) from the run's cost curve.  The seconds go onto the target's
``clock``, which the engine reads instead of the wall clock, so every time the engine measures
(verify time, a policy's observations, decode tok/s) is real Python and drafting plus priced calls.

Example: a recording ``prompt [1, 2]``, output ``[4, 5, 6]``.  Once the prompt is in, a step
decoding ``[2, 4, 9]`` (pending 2, draft 4, 9) gets rows answering 4 (after ``1 2``), 5 (after
``1 2 4``), and a filler for the row after ``9``, a context no recording holds (greedy
verification stops before it reads that row).

What cannot be known: what the target says after a context that leaves its recording (past a
rejected draft token, or past end-of-generation).  Such rows answer a token that no draft token
there matches, so verification accepts nothing there; the live engine may count tokens accepted
after EOS that replay does not.  A recurrent target's checkpoint and restore time is not priced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..draft_length.costs import CostModel
from ..errors import ContextOverflowError, InvalidParameterError, SpecstackError
from ..llama.target import ModelConfig
from ..llama.batching import BatchShapes, Segment, decode_calls, prefill_call
from ..llama.recurrent import RewindStats
from .results import PLAIN

FILLER_LOGIT = -1e4  # every other token's logit in a dense row: the recorded token has probability 1


class RecordingError(SpecstackError):
    """The engine asked a recorded target for a row no recording answers."""


@dataclass(frozen=True)
class Recording:
    """One request as a run recorded it: its prompt ids and the target's greedy output ids."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


class PredictedRows:
    """Logits rows reduced to what greedy verification reads, each row's argmax (``tokens``).

    ``argmax(axis=1)`` costs nothing; anything else (``np.asarray``, sampling, logprobs) sees dense rows
    of ``n_vocab`` logits, 0 at the row's token and ``FILLER_LOGIT`` elsewhere: a target certain of it.
    """

    __slots__ = ("tokens", "n_vocab")
    ndim = 2

    def __init__(self, tokens: Sequence[int] | np.ndarray, n_vocab: int) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.n_vocab = n_vocab

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.tokens), self.n_vocab)

    def __len__(self) -> int:
        return len(self.tokens)

    def argmax(self, axis: int | None = None) -> np.ndarray:
        if axis not in (1, -1):
            raise ValueError("recorded rows know each row's most likely token: argmax(axis=1)")
        return self.tokens.copy()

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (int, np.integer)):
            return np.asarray(PredictedRows(self.tokens[index : index + 1 or None], self.n_vocab))[0]
        return PredictedRows(self.tokens[index], self.n_vocab)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.full((len(self.tokens), self.n_vocab), FILLER_LOGIT, dtype=np.float32)
        out[np.arange(len(self.tokens)), self.tokens] = 0.0
        return out if dtype is None else out.astype(dtype)


def pricing_model(curve_s: Sequence[float]) -> CostModel:
    """The cost model's t(n) as measured at each n (no smoothing: a call is priced at its own size's point),
    extrapolated past the curve as the cost model does."""
    n = len(curve_s)
    return CostModel(list(curve_s), shapes=BatchShapes(min_rows=1, pad_to=tuple(range(1, n + 1))))


class RecordedTarget:
    """An ``EngineTarget`` answering every row from ``recordings`` and pricing every call with ``costs``.

    ``shapes``, ``n_slots``, ``n_seq_max`` and the rest are the recorded run's target's, so the engine
    budgets, splits and pads as it did.  ``clock()`` is the wall clock plus the priced seconds of every
    call less the real seconds the call took here (an ``Engine(..., clock=target.clock)`` times steps by it);
    ``priced_s`` and ``call_rows`` total what was priced.
    """

    def __init__(self, recordings: Sequence[Recording], *, n_vocab: int, n_ctx: int,
                 shapes: BatchShapes | None = None, costs: CostModel | None = None,
                 eog: frozenset[int] = frozenset(), path: Path | None = None, n_threads: int = 1, n_slots: int = 1,
                 n_seq_max: int = 1, unified: bool | None = None, batch_cap: int = 512, prefill_chunk: int = 128,
                 memory: str = "attention", strategy: str = "truncate", max_draft: int = 1 << 30) -> None:
        # Longest prompt first: a context matching two recordings (one prompt extends the other) is the
        # request with the longer prompt, whose own output was recorded.
        self._streams = sorted(((len(r.prompt_ids), [*r.prompt_ids, *r.output_ids]) for r in recordings),
                               key=lambda s: -s[0])
        self.path = path
        self.n_vocab, self.n_ctx, self.n_threads = n_vocab, n_ctx, n_threads
        self.n_slots = max(1, n_slots)
        self.unified = self.n_slots == 1 if unified is None else unified
        self.memory, self.strategy, self.max_draft = memory, strategy, max_draft
        self.is_recurrent = memory != "attention"
        self.n_seq_max = max(self.n_slots, n_seq_max if self.unified and not self.is_recurrent else 1)
        self.config = ModelConfig(path=path or Path("recorded"), n_ctx=n_ctx, n_threads=n_threads, n_batch=batch_cap,
                                  n_slots=self.n_slots, n_seq_max=self.n_seq_max, unified=self.unified,
                                  prefill_chunk=prefill_chunk)
        self.batch_cap = batch_cap
        self.bos_id = -1
        self.costs = costs
        self.rewind = RewindStats()
        self.tree_relayouts = 0
        self.gate = contextlib.nullcontext()
        self.seq_len = [0] * self.n_seq_max
        self.writes = [0] * self.n_seq_max
        self._kv: list[list[int]] = [[] for _ in range(self.n_seq_max)]
        self._match: list[tuple[int, int] | None] = [None] * self.n_seq_max  # (stream, leading KV tokens it matches)
        self._tree: tuple[int, list[int]] | None = None
        self._eog = frozenset(eog)
        self._offset = 0.0
        self.priced_s = 0.0
        self.call_rows: list[int] = []
        self.set_shapes(shapes or BatchShapes(settled=True))

    # -- what the run recorded -------------------------------------------------------------------

    @classmethod
    def from_results(cls, results: dict[str, Any], statistic: str = "min_s") -> "RecordedTarget":
        """The target of a bench results dict: its plain temperature-0 outputs, shapes and cost curve
        (``statistic``: ``min_s``, the fastest rep the cost policy keeps, or ``median_s``)."""
        t = results["config"]["target"]
        plain = recorded_outputs(results)
        recordings = [Recording(tuple(q["prompt_ids"]), tuple(plain[q["id"]]["output_ids"]))
                      for q in results["workload"]["requests"] if q["id"] in plain]
        eog = frozenset(r["output_ids"][-1] for r in plain.values()
                        if r["output_ids"] and r["stats"].get("stop_reason") == "eos")
        curve = results.get("cost_curve")
        costs = pricing_model(curve[statistic]) if curve and curve.get(statistic) else None
        path = Path(t["path"])
        return cls(recordings, n_vocab=t["n_vocab"], n_ctx=t["n_ctx"], shapes=recorded_shapes(t), costs=costs, eog=eog,
                   path=path if path.is_file() else None, n_threads=t["threads"], n_slots=t.get("n_slots", 1),
                   n_seq_max=t.get("n_seq_max", 1), unified=t.get("unified"), batch_cap=t.get("batch_cap", 512),
                   prefill_chunk=t.get("prefill_chunk", 128), memory=t.get("memory", "attention"),
                   strategy=t.get("strategy", "truncate"), max_draft=t.get("max_draft", 1 << 30))

    # -- time ------------------------------------------------------------------------------------

    def clock(self) -> float:
        """Seconds as the engine should see them: the wall clock with each call's real time replaced by its price."""
        return time.perf_counter() + self._offset

    def _spend(self, t0: float, rows: Sequence[int]) -> None:
        priced = sum(self.costs.call_s(n) for n in rows) if self.costs is not None else 0.0
        self._offset += priced - (time.perf_counter() - t0)
        self.priced_s += priced
        self.call_rows.extend(rows)

    # -- the EngineTarget protocol ---------------------------------------------------------------

    def set_shapes(self, shapes: BatchShapes) -> None:
        """As ``LlamaModel.set_shapes``: calls within the batch, even rows on separate streams, room for pads."""
        even = not (self.unified and self.n_slots > 1 and not shapes.exact)
        cap = min(shapes.max_rows, self.batch_cap)
        self.shapes = dataclasses.replace(shapes, max_rows=max(cap, shapes.min_rows), even_rows=even)
        self.min_batch = self.shapes.min_rows
        self.capacity = self.n_ctx - (self.min_batch - 1)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        raise InvalidParameterError("a recorded target has no tokenizer: give the prompt as token ids")

    def token_bytes(self, token: int) -> bytes:
        return b""  # no vocabulary: replay reads token ids, never text

    def eog_ids(self) -> frozenset[int]:
        return self._eog

    def prefill(self, tokens: Sequence[int], seq: int = 0) -> None:
        """Prompt tokens in chunks whose edges sit at multiples of ``prefill_chunk``, each priced as its call."""
        t0 = time.perf_counter()
        chunk = prefill_call(self.config.prefill_chunk, self.batch_cap)
        rows, at, end = [], self.seq_len[seq], self.seq_len[seq] + len(tokens)
        while at < end:
            m = min(end - at, (at // chunk + 1) * chunk - at)
            self._check_room(seq, at - self.seq_len[seq] + max(m, self.min_batch))
            rows.append(max(m, self.min_batch))
            at += m
        self._kv[seq].extend(int(t) for t in tokens)
        self.seq_len[seq] = len(self._kv[seq])
        self.writes[seq] += 1
        self._match[seq] = None  # a new prompt: which recording it is is settled by the next decode
        self._spend(t0, rows)

    def decode(self, segments: Sequence[Segment]) -> list[PredictedRows | None]:
        """Each segment's rows from ``logits_from`` on, answered from its recording; priced call by call."""
        t0 = time.perf_counter()
        for s in segments:
            self._check_room(s.seq, len(s.tokens))
        groups = [[s] for s in segments] if len(segments) > 1 and self.is_recurrent else [list(segments)]
        rows = [sum(p.count + p.pad for p in call) for group in groups for call in decode_calls(
            self.shapes, [len(s.tokens) for s in group], [s.seq for s in group],
            [self.n_ctx - self.seq_len[s.seq] - len(s.tokens) for s in group])]
        out: list[PredictedRows | None] = []
        for s in segments:
            answers = self._append(s.seq, [int(t) for t in s.tokens], answer_first=s.logits_from == 0)
            out.append(None if s.logits_from >= len(s.tokens) else PredictedRows(answers[s.logits_from :], self.n_vocab))
        self._spend(t0, rows)
        return out

    def truncate(self, n_keep: int, seq: int = 0) -> None:
        if n_keep >= self.seq_len[seq]:
            return
        del self._kv[seq][n_keep:]
        self.seq_len[seq] = n_keep
        self.writes[seq] += 1
        m = self._match[seq]
        if m is not None:
            self._match[seq] = (m[0], min(m[1], n_keep))

    def can_truncate(self, n_keep: int, seq: int = 0) -> bool:
        return True

    def checkpoint(self, seq: int = 0) -> None:
        pass  # recurrent state is not modelled: a cut is free here

    def protect(self, seq: int, n: int, one_call: bool = True) -> None:
        pass

    def reset(self, seq: int | None = None) -> None:
        for s in range(self.n_seq_max) if seq is None else (seq,):
            self._kv[s], self._match[s], self.seq_len[s] = [], None, 0
            self.writes[s] += 1

    def save_seq(self, seq: int) -> bytes:
        return json.dumps(self._kv[seq]).encode()

    def load_seq(self, seq: int, data: bytes, n_tokens: int) -> bool:
        self.reset(seq)
        self._kv[seq] = list(json.loads(data))[:n_tokens]
        self.seq_len[seq] = len(self._kv[seq])
        self.writes[seq] += 1
        return True

    def eval_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> PredictedRows:
        """A token tree on sequence 0 in one unpadded call, as ``LlamaModel.eval_tree``; every node's row."""
        t0 = time.perf_counter()
        n = len(tokens)
        if self.is_recurrent:
            raise ValueError(f"a {self.memory} target verifies chains, not trees")
        if n < 2 or n > self.batch_cap or self.seq_len[0] + n > self.capacity:
            raise ValueError(f"tree of {n} tokens does not fit (batch {self.batch_cap}, "
                             f"context {self.capacity - self.seq_len[0]} left)")
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            children[parents[i]].append(int(tokens[i]))
        if sum(1 for c in children if not c) > self.n_seq_max:
            raise ValueError(f"tree has more branches than the context allows ({self.n_seq_max})")
        stream = self._streams[self._stream_for(0, int(tokens[0]))][1]
        start = self.seq_len[0]
        if start + 1 >= len(stream):
            raise RecordingError(f"the engine asked for a token past the end of a recording ({len(stream)} tokens)")
        depth, on = [0] * n, [False] * n  # ``on``: the node's path from the root follows the recording
        answers = []
        for i in range(n):
            if i:
                depth[i] = depth[parents[i]] + 1
            pos = start + depth[i]
            on[i] = (i == 0 or on[parents[i]]) and pos < len(stream) and stream[pos] == tokens[i]
            answers.append(stream[pos + 1] if on[i] and pos + 1 < len(stream) else _other(children[i], self.n_vocab))
        self._tree = (start, [int(t) for t in tokens])
        self.seq_len[0] = start + max(depth) + 1
        self.writes[0] += 1
        self._spend(t0, [n])
        return PredictedRows(answers, self.n_vocab)

    def commit_tree(self, path: Sequence[int]) -> None:
        """Keep ``path``'s nodes; a path other than the first branch is decoded again as a chain (one more call)."""
        assert self._tree is not None, "commit_tree without eval_tree"
        start, tokens = self._tree
        self._tree = None
        self.seq_len[0] = start
        chain = [tokens[i] for i in path]
        if list(path) == list(range(len(path))):
            self._append(0, chain)
            return
        self.tree_relayouts += 1
        self.decode([Segment(0, chain, len(chain))])

    def raw_call(self, tokens: Sequence[int], outputs: bool = True, seq: int = 0, pad: int = 0,
                 pad_logits: bool | None = None) -> np.ndarray:
        raise InvalidParameterError("a recorded target is never measured: its shapes and costs come with the recording")

    # -- answering from the recordings -----------------------------------------------------------

    def _check_room(self, seq: int, n: int) -> None:
        if self.seq_len[seq] + n > self.n_ctx:
            raise ContextOverflowError(f"recorded target context is full: {self.seq_len[seq]} + {n} tokens > "
                                       f"n_ctx {self.n_ctx}")

    def _stream_for(self, seq: int, first: int) -> int:
        """The recording whose tokens start with ``seq``'s KV followed by ``first`` (the row-0 token)."""
        kv, m = self._kv[seq], self._match[seq]
        n = len(kv)
        if m is not None:
            stream = self._streams[m[0]][1]
            if m[1] >= n and n < len(stream) and stream[n] == first:
                return m[0]
        for i, (n_prompt, stream) in enumerate(self._streams):
            if n_prompt <= n + 1 and n < len(stream) and stream[n] == first and stream[:n] == kv:
                self._match[seq] = (i, n)
                return i
        raise RecordingError(f"no recording holds this context ({n + 1} tokens, ending {[*kv[-4:], first]}): "
                             "replay can only run the recorded requests")

    def _append(self, seq: int, tokens: list[int], answer_first: bool = False) -> list[int]:
        """Append ``tokens`` to ``seq``; per row, the token the target gives after it (recorded, or a filler).
        ``answer_first``: the first row is read whatever the draft (it gives the step's token), so it must be
        recorded."""
        idx = self._stream_for(seq, tokens[0])
        stream = self._streams[idx][1]
        start = len(self._kv[seq])
        if answer_first and start + 1 >= len(stream):
            raise RecordingError(f"the engine asked for a token past the end of a recording ({len(stream)} tokens): "
                                 "replay generates no more than the run recorded")
        answers, agree = [], 0
        for j, tok in enumerate(tokens):
            pos = start + j
            if agree == j and pos < len(stream) and stream[pos] == tok:
                agree += 1
            if agree > j and pos + 1 < len(stream):
                answers.append(stream[pos + 1])
            else:
                answers.append(_other(tokens[j + 1 : j + 2], self.n_vocab))
        self._kv[seq].extend(tokens)
        self.seq_len[seq] = len(self._kv[seq])
        self.writes[seq] += 1
        self._match[seq] = (idx, start + agree)
        return answers


def _other(avoid: Sequence[int], n_vocab: int) -> int:
    """A token none of ``avoid`` (the next draft tokens): what the target said there was not recorded."""
    return next(t for t in range(n_vocab) if t not in avoid)


def recorded_shapes(target: dict[str, Any]) -> BatchShapes:
    """The run's target shapes from results.json (``records.config_dict``); older files recorded only
    ``min_rows`` and ``exact``, which then stand for the rest (no split, no ``pad_to``)."""
    d = target.get("shapes")
    if d is None:
        return BatchShapes(min_rows=target.get("min_rows", 2), exact=target.get("exact", True), settled=True)
    base = BatchShapes.from_dict({k: v for k, v in d.items() if k not in ("pad_to", "even_rows")})
    return dataclasses.replace(base, settled=True, pad_to=tuple(d.get("pad_to", ())), even_rows=d.get("even_rows", True))


def recorded_outputs(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """request id -> its first plain temperature-0 run (the reference outputs)."""
    out: dict[str, dict[str, Any]] = {}
    for r in results["runs"]:
        if r["method"] == PLAIN and float(r["temperature"]) == 0.0 and r["request"] not in out:
            out[r["request"]] = r
    if not out:
        raise InvalidParameterError(
            "replay needs plain (none) runs at temperature 0 in the results; re-run `specstack bench` with --temp 0"
        )
    return out
