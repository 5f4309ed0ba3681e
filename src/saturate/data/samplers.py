"""Which samples a rank reads, in which order: a training epoch's shuffled, resumable share
(ResumableSampler), an evaluation set's share in order (EvalShard). The resident and the
streaming loaders draw the same order from them for the same seed."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from saturate.config.schema import LoaderConfig
from saturate.data.samples import length

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """Which share of the samples this rank reads (`rank` of `world_size`), in the order
    `seed` (and the epoch) draws."""

    seed: int = 0
    rank: int = 0
    world_size: int = 1


ONE_PROCESS = Shard()  # the default share: every sample, one process


GROUP_SPAN = 4  # groups (shards) shuffled together: a worker reads from about this many at a time


def grouped_permutation(sizes: list[int], generator: torch.Generator, span: int = GROUP_SPAN) -> list[int]:
    """A shuffle that keeps reads local: the groups (contiguous index ranges of these sizes,
    e.g. a data set's shards) in a random order, `span` of them at a time shuffled together.
    A function of the generator's seed only, like torch.randperm."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    order = torch.randperm(len(sizes), generator=generator).tolist()
    indices: list[int] = []
    for k in range(0, len(order), span):
        members = torch.cat([torch.arange(starts[g], starts[g] + sizes[g]) for g in order[k : k + span]])
        indices += members[torch.randperm(len(members), generator=generator)].tolist()
    return indices


def drawn_seed() -> int:
    """One int64 from torch's global generator, drawn as torch.utils.data draws a DataLoader
    iterator's base seed and RandomSampler (no generator given) its epoch's seed."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


class ResumableSampler(DistributedSampler):
    """DistributedSampler (sharded by rank) that can start an epoch part-way through, at the
    first sample of batch `start`. Its epoch's order is torch.randperm under a seed: seed +
    epoch (`order="seeded"`, DistributedSampler's), or one drawn from torch's global generator
    (`order="global"`, RandomSampler's draw: a plain loop's order for the same seed; the
    draw made before a resume inside the epoch is kept, see state_dict). With `keyed`, it
    yields (epoch, index) so that a per-sample augmentation in a worker knows the epoch. A
    data set with `sample_groups` (its shards' sizes) is shuffled group-wise
    (grouped_permutation)."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        keyed: bool,
        order: str = "seeded",
    ):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        self.batch_size, self.start, self.keyed, self.order = batch_size, 0, keyed, order
        self.groups = getattr(dataset, "sample_groups", None)
        self.drawn: tuple[int, int] | None = None  # order=global: (epoch, the seed drawn for it)

    def epoch_seed(self) -> int:
        """The seed of this epoch's order (a global one is drawn here, unless the epoch resumes
        part-way through with the seed drawn when it began)."""
        if self.order == "seeded":
            return self.seed + self.epoch
        if not (self.start > 0 and self.drawn is not None and self.drawn[0] == self.epoch):
            self.drawn = (self.epoch, drawn_seed())
        return self.drawn[1]

    def permutation(self) -> torch.Tensor:
        """All samples in this epoch's order, before sharding."""
        generator = torch.Generator().manual_seed(self.epoch_seed())
        if self.groups:
            return torch.tensor(grouped_permutation(self.groups, generator), dtype=torch.int64)
        return torch.randperm(length(self.dataset), generator=generator)

    def shard(self, order: torch.Tensor) -> torch.Tensor:
        """This rank's share, as DistributedSampler takes it: equal shares (the order repeated
        from its start to fill the last), every world_size-th sample from `rank`."""
        if self.drop_last:
            order = order[: self.total_size]
        elif (padding := self.total_size - len(order)) > 0:
            order = torch.cat([order, order.repeat(-(-padding // len(order)))[:padding]])
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator:
        indices = self.shard(self.permutation())[self.start * self.batch_size :].tolist()
        return ((self.epoch, i) for i in indices) if self.keyed else iter(indices)

    def __len__(self) -> int:
        return self.num_samples - self.start * self.batch_size

    def state_dict(self) -> dict:
        """What a resume inside an epoch needs of the order: the seed drawn for it (global)."""
        return {"order": self.order, "drawn": list(self.drawn) if self.drawn else None}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("order", "seeded")
        if saved != self.order:
            log.warning(
                "loader.order=%s, the checkpoint's run had %s: an epoch resumed part-way through mixes the two orders "
                "(samples seen twice or not at all); resume at an epoch's end, or with loader.order=%s",
                self.order,
                saved,
                saved,
            )
        drawn = state.get("drawn") if saved == self.order else None
        self.drawn = tuple(drawn) if drawn else None


class EvalShard(torch.utils.data.Sampler):
    """This rank's share of an evaluation set, in order and without the padding a
    DistributedSampler adds (it would count some samples twice)."""

    def __init__(self, n: int, rank: int, world_size: int):
        self.indices: range | list[int] = range(rank, n, world_size)
        self.num_samples, self.start = len(self.indices), 0

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


class DrawnShard(EvalShard):
    """This rank's share of `count` samples drawn at random, without replacement, from an
    evaluation set of `n` (trainer.limit_val_random, trainer.train_est_batches: nanoGPT's
    estimate_loss). Each evaluation draws anew: `set_epoch(key)` with the step it is made at,
    so that a resumed run draws what the uninterrupted one drew."""

    def __init__(self, n: int, count: int, *, seed: int, rank: int, world_size: int):
        self.n, self.count, self.seed, self.rank, self.world_size = n, count, seed, rank, world_size
        self.set_epoch(0)
        self.num_samples, self.start = len(self.indices), 0

    def set_epoch(self, epoch: int) -> None:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        drawn = torch.randperm(self.n, generator=generator)[: self.count]
        self.indices = drawn[self.rank :: self.world_size].tolist()


class Streams(torch.utils.data.Sampler):
    """loader.order=sequential: the samples as `batch_size` parallel streams read in order, each
    batch the next sample of every stream (the `batchify` layout of word-level language models,
    for a state carried from one batch to the next). A data set of N consecutive windows is cut
    into B x world_size contiguous streams of L = N // (B x world_size) samples; this rank reads
    streams rank x B to (rank + 1) x B - 1, and its batch k is the k-th sample of each. The last
    N mod (B x world_size) samples are left out, as batchify trims its sequence. The order is the
    same every epoch; a resumed epoch starts at its batch `start`."""

    def __init__(self, n: int, batch_size: int, *, rank: int, world_size: int, keyed: bool = False):
        self.length = n // (batch_size * world_size)  # samples per stream
        starts = torch.arange(rank * batch_size, (rank + 1) * batch_size) * self.length
        self.order = (starts[None, :] + torch.arange(self.length)[:, None]).reshape(-1)
        self.batch_size, self.keyed, self.epoch, self.start = batch_size, keyed, 0, 0
        self.num_samples = len(self.order)
        self.indices = self.order.tolist()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def permutation(self) -> torch.Tensor:
        return self.order

    def shard(self, order: torch.Tensor) -> torch.Tensor:
        return order

    def __iter__(self) -> Iterator:
        indices = self.indices[self.start * self.batch_size :]
        return ((self.epoch, i) for i in indices) if self.keyed else iter(indices)

    def __len__(self) -> int:
        return self.num_samples - self.start * self.batch_size

    def state_dict(self) -> dict:
        return {"order": "sequential", "drawn": None}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("order", "seeded")
        if saved != "sequential":
            log.warning(
                "loader.order=sequential, the checkpoint's run had %s: an epoch resumed part-way through reads "
                "other samples than it began with; resume at an epoch's end, or with loader.order=%s",
                saved,
                saved,
            )


def epoch_sampler(
    dataset: Dataset, cfg: LoaderConfig, *, train: bool, shard: Shard, keyed: bool = False, drawn: int = 0
):
    """Training: shuffled (loader.order), sharded by rank, resumable; or in streams
    (loader.order=sequential). Evaluation: this rank's share in order, unpadded (in streams
    of `batch_size` under loader.order=sequential); or `drawn` samples drawn at random at each
    evaluation."""
    if cfg.order == "sequential":
        return Streams(length(dataset), cfg.batch_size, rank=shard.rank, world_size=shard.world_size, keyed=keyed)
    if train:
        return ResumableSampler(
            dataset,
            batch_size=cfg.batch_size,
            seed=shard.seed,
            rank=shard.rank,
            world_size=shard.world_size,
            keyed=keyed,
            order=cfg.order,
        )
    if drawn:
        return DrawnShard(length(dataset), drawn, seed=shard.seed, rank=shard.rank, world_size=shard.world_size)
    return EvalShard(length(dataset), shard.rank, shard.world_size)


def batches_per_epoch(samples: int, batch_size: int, drop_last: bool, limit: int) -> int:
    full = samples // batch_size if drop_last else -(-samples // batch_size)
    return full if limit < 0 else min(full, limit)
