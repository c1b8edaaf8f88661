"""A synthetic token stream for torchtitan's trainer, through its own extension points (nothing to download).

:class:`AffineTokenizer` (a torchtitan ``BaseTokenizer``: the vocabulary and nothing else) and
:class:`AffineDataLoader` (a torchtitan ``BaseDataLoader``, checkpointed with the trainer's DCP state).

Sequence ``i`` of the stream (``i = 0, 1, 2, ...``) follows ``x[t+1] = (a * x[t] + b) mod vocab`` from ``x[0]``,
with ``a`` in ``[1, 7]``, ``b`` in ``[0, 7]`` and ``x[0]`` in ``[0, vocab)`` drawn from ``Random(seed * 2**32 + i)``:
a pure function of ``(seed, i)``, so the same for every run, variant and rank count, and the loss falls as
the model learns to read ``a`` and ``b`` off the context. Each sequence is one document (positions
``0 .. seq_len - 1``). Batch ``k`` of data-parallel rank ``r`` of ``W`` holds sequences
``(k * W + r) * B .. (k * W + r + 1) * B - 1``: step ``k``'s global batch is the stream's next ``W * B``
sequences whatever ``W`` is. The state a checkpoint keeps is ``k`` (per rank, under the key torchtitan's
own dataloaders use), so a resumed job continues with the batches the interrupted one would have read.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

A_RANGE, B_RANGE = (1, 7), (0, 7)


class AffineTokenizer(BaseTokenizer):
    """The synthetic stream's tokenizer: token ids are the text (``"17 4 9"``); no files."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, *, tokenizer_path: str | None = None):
        super().__init__()
        if not (isinstance(config.vocab_size, int) and config.vocab_size >= 2):
            raise ValueError(f"vocab_size must be an int >= 2, got {config.vocab_size!r}")
        self.vocab_size = config.vocab_size
        del tokenizer_path  # torchtitan passes its hf_assets_path; nothing is read

    def encode(self, text: str, *args, **kwargs) -> list[int]:
        return [int(tok) for tok in text.split()]

    def decode(self, ids, *args, **kwargs) -> str:
        return " ".join(str(int(i)) for i in ids)

    def get_vocab_size(self) -> int:
        return self.vocab_size


@functools.lru_cache(maxsize=4)
def _tables(length: int, vocab: int) -> tuple:
    """``(a^t mod vocab, (a^0 + ... + a^(t-1)) mod vocab)`` for every ``a`` of ``A_RANGE`` and ``t < length``."""
    a = torch.arange(A_RANGE[0], A_RANGE[1] + 1)
    power, total = torch.empty(len(a), length, dtype=torch.int64), torch.empty(len(a), length, dtype=torch.int64)
    p, s = torch.ones_like(a), torch.zeros_like(a)
    for t in range(length):
        power[:, t], total[:, t] = p, s
        p, s = (p * a) % vocab, (s + p) % vocab
    return power, total


def affine_sequences(first: int, count: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Sequences ``first .. first + count - 1`` of the stream, ``length`` tokens each: ``(count, length)`` int64
    (``x[t] = a^t x[0] + b (a^0 + ... + a^(t-1)) mod vocab``)."""
    a, b, x0 = [], [], []
    for i in range(first, first + count):
        rng = random.Random(seed * 2**32 + i)
        a.append(rng.randint(*A_RANGE))
        b.append(rng.randint(*B_RANGE))
        x0.append(rng.randrange(vocab))
    power, total = _tables(length, vocab)
    rows = torch.tensor(a) - A_RANGE[0]
    return (power[rows] * torch.tensor(x0)[:, None] + torch.tensor(b)[:, None] * total[rows]) % vocab


class AffineDataLoader(BaseDataLoader):
    """Batches of the synthetic stream for one data-parallel rank: ``({"input", "positions"}, labels)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "affine"
        seed: int = 0
        """The stream's seed (every variant and rank count reads the same stream)."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer, seq_len: int,
                 local_batch_size: int, **_unused):
        for name, value, low in (("seq_len", seq_len, 1), ("local_batch_size", local_batch_size, 1),
                                 ("dp_world_size", dp_world_size, 1), ("dp_rank", dp_rank, 0)):
            if not (isinstance(value, int) and value >= low):
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if dp_rank >= dp_world_size:
            raise ValueError(f"dp_rank must be in [0, dp_world_size={dp_world_size}), got {dp_rank}")
        self.seed, self.vocab = config.seed, tokenizer.get_vocab_size()
        self.seq_len, self.batch = seq_len, local_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.next_batch = 0
        self._rank_id = f"dp_rank_{dp_rank}"  # the per-rank key of torchtitan's own dataloaders

    def batch_at(self, k: int):
        """This rank's batch ``k``."""
        first = (k * self.dp_world_size + self.dp_rank) * self.batch
        x = affine_sequences(first, self.batch, self.seq_len + 1, self.vocab, self.seed)
        positions = torch.arange(self.seq_len).expand(self.batch, self.seq_len).contiguous()
        return {"input": x[:, :-1].contiguous(), "positions": positions}, x[:, 1:].contiguous()

    def __iter__(self):
        while True:
            batch = self.batch_at(self.next_batch)
            self.next_batch += 1
            yield batch

    def state_dict(self) -> dict:
        return {self._rank_id: self.next_batch, "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        if self._rank_id not in state_dict:
            raise ValueError(f"AffineDataLoader: the checkpoint has no state for {self._rank_id}")
        if state_dict["world_size"] != self.dp_world_size:
            raise ValueError(f"AffineDataLoader: the checkpoint was written by {state_dict['world_size']} "
                             f"data-parallel ranks, this job has {self.dp_world_size} (the batches would differ)")
        self.next_batch = int(state_dict[self._rank_id])


__all__ = ["AffineTokenizer", "AffineDataLoader", "affine_sequences"]
