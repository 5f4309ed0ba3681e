"""A state carried from one batch to the next (truncated BPTT): batches in streams
(loader.order=sequential), the state passed on by the task (task.carry), started afresh at each
epoch and evaluation, kept in checkpoints; and a task's own state left as it was by saturate's
checks and measurements."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import saturate
from saturate.config.schema import LoaderConfig
from saturate.data.samplers import ONE_PROCESS, Shard, Streams, epoch_sampler
from saturate.errors import UserError
from saturate.loop.faults import Preempted
from saturate.tasks.classification import Classification
from tests.checkpoint.test_resume import final_weights, signal_at, step_losses
from tests.conftest import read_metrics

VOCAB = 7


class Windows(Dataset):
    """Consecutive windows of a token sequence, each with the next tokens as its targets: sample
    i + 1 follows sample i (a stream)."""

    stream = True
    num_classes = VOCAB

    def __init__(self, tokens: torch.Tensor, length: int):
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.length

    def __getitem__(self, i: int):
        at = i * self.length
        return self.tokens[at : at + self.length], self.tokens[at + 1 : at + self.length + 1]


def sequence(n: int, seed: int) -> torch.Tensor:
    """Tokens of which three in four repeat the one two places back: learnable only with a memory."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(3, n):
        if t % 4:
            tokens[t] = tokens[t - 2]
    return tokens


def streams(length: int = 8, **_):
    return {"train": Windows(sequence(2400, 0), length), "val": Windows(sequence(800, 1), length)}


class TinyLSTM(nn.Module):
    """A language model that carries its hidden state: forward(x, state) -> (logits, state)."""

    def __init__(self, num_classes: int, hidden: int = 16, **_):
        super().__init__()
        self.embed, self.rnn = nn.Embedding(num_classes, 8), nn.LSTM(8, hidden, batch_first=True)
        self.head, self.drop = nn.Linear(hidden, num_classes), nn.Dropout(0.1)
        self.seen: list = []  # (training, the state received) of each call

    def forward(self, x, state):
        self.seen.append((self.training, None if state is None else tuple(s.clone() for s in state)))
        out, state = self.rnn(self.drop(self.embed(x)), state)
        return self.head(out), state


LM = [
    "data._target_=tests.tasks.test_stateful.streams",
    "~data.val_fraction",
    "~data.split_seed",
    "model._target_=tests.tasks.test_stateful.TinyLSTM",
    "~model.width",
    "~model.norm",
    "loader.order=sequential",
    "loader.batch_size=10",
    "loader.eval_batch_size=5",
    "task.carry=true",
    "optim=adam",
    "optim.optimizer.lr=0.03",
    "optim.warmup_epochs=0",
    "monitor.costs=false",
]


def test_streams_read_contiguous_windows_in_parallel():
    order = Streams(23, 4, rank=0, world_size=1)
    batches = [order.indices[k : k + 4] for k in range(0, order.num_samples, 4)]
    assert batches == [[0, 5, 10, 15], [1, 6, 11, 16], [2, 7, 12, 17], [3, 8, 13, 18], [4, 9, 14, 19]]
    second = Streams(23, 2, rank=1, world_size=2)  # four streams of 5: this rank reads the last two
    assert second.indices[:4] == [10, 15, 11, 16] and len(second) == 10
    second.start = 3
    assert list(second)[:2] == [13, 18]  # a resumed epoch starts at its batch


def test_evaluation_reads_streams_of_its_own_batch_size():
    cfg = LoaderConfig(order="sequential", batch_size=5)
    sampler = epoch_sampler(Windows(sequence(100, 0), 8), cfg, train=False, shard=ONE_PROCESS)
    assert sampler.indices[:5] == [0, 2, 4, 6, 8] and sampler.num_samples == 10
    drawn = epoch_sampler(range(50), LoaderConfig(), train=False, shard=Shard(seed=3), drawn=10)
    first = list(drawn)
    drawn.set_epoch(7)
    assert len(first) == 10 == len(set(first)) and list(drawn) != first  # drawn anew at each evaluation
    drawn.set_epoch(0)
    assert list(drawn) == first  # by the key it is given: a resumed run draws what the uninterrupted one drew


def test_the_state_is_carried_detached_and_starts_afresh_each_epoch_and_evaluation(make_cfg):
    cfg = make_cfg(*LM, "trainer.max_epochs=3", "trainer.limit_train_batches=-1", "trainer.limit_val_batches=-1")
    saturate.train(cfg)
    record = read_metrics(cfg.run_dir)
    assert record["status"] == "completed" and record["val/loss"] < 1.8  # ln(7) = 1.95: it learned from the past
    # 2400 tokens in windows of 8: 299 samples, 10 streams of 29 (9 left out); validation: 5 streams of 19
    assert record["progress/step"] == 3 * 29


def test_the_model_gets_its_state_from_the_last_batch_of_its_stream(tmp_path):
    model = TinyLSTM(VOCAB)
    data = streams()
    saturate.fit(
        model,
        data["train"],
        data["val"],
        task=Classification(VOCAB, carry=True),
        overrides=[*LM[6:9], "trainer.max_epochs=2", "optim.warmup_epochs=0", "trainer.progress=false", LM[-1]],
        run_dir=tmp_path,
    )
    calls = [(training, state) for training, state in model.seen]
    train_calls = [i for i, (training, _) in enumerate(calls) if training]
    starts = [i for i in train_calls if calls[i][1] is None]
    # each epoch's first step starts from nothing, every other step from the last one's state
    assert len(train_calls) == 58 and len(starts) == 2
    evaluations = [
        calls[i + 1 : j] for i, j in zip(train_calls[28::29], [*train_calls[29::29], len(calls)], strict=True)
    ]
    assert len(evaluations[0]) == 19  # after the last, the report's probes run the model on two samples
    for evaluation in evaluations:  # 19 batches of 5 streams, the first from nothing
        assert evaluation[0][1] is None
        assert all(state is not None and state[0].shape == (1, 5, 16) for _, state in evaluation[1:19])
    assert all(not s.requires_grad for i in train_calls if calls[i][1] for s in calls[i][1])


def test_a_resumed_run_continues_the_streams_bit_for_bit(make_cfg):
    """SIGTERM mid-epoch: the checkpoint holds the carried state (and the streams' position);
    the resumed run's losses and weights are the uninterrupted run's."""
    exact = [*LM, "trainer.max_epochs=2", "trainer.deterministic=true", "trainer.limit_train_batches=-1"]
    exact += ["loader.num_workers=1"]  # batches from a worker process, in order
    first = make_cfg(*exact, *signal_at(40, signal.SIGTERM))
    with pytest.raises(Preempted) as stopped:
        saturate.train(first)
    assert stopped.value.code == 128 + signal.SIGTERM
    saved = torch.load(Path(first.run_dir) / "checkpoints" / "last.pt", weights_only=True)
    assert saved["step"] == 40 and saved["task"]["carried"][0].shape == (1, 10, 16)
    second = make_cfg(*exact, f"trainer.resume={first.run_dir}")
    saturate.train(second)
    full = make_cfg(*exact)
    saturate.train(full)
    assert step_losses(first.run_dir, second.run_dir) == step_losses(full.run_dir)
    for key, value in final_weights(full.run_dir).items():
        assert torch.equal(value, final_weights(second.run_dir)[key]), key


class Stateful(Classification):
    """A user's task keeping its own state in tensors, without the carry option: one it
    replaces and one it changes in place."""

    def __init__(self, num_classes: int):
        super().__init__(num_classes)
        self.hidden, self.seen, self.calls = torch.zeros(3), {"sum": torch.zeros(())}, 0

    def forward(self, model, batch):
        self.hidden, self.calls = torch.ones(3), self.calls + 1
        self.seen["sum"] += 1
        loss, outputs = super().forward(model, batch)
        self.last = outputs.detach()  # a state that did not exist before the first call
        return loss, outputs


def test_saturates_checks_and_measurements_leave_a_tasks_own_state_as_it_was(tmp_path):
    seen = []

    class Watch:
        def on_run_start(self, run):
            seen.append((task.hidden.tolist(), float(task.seen["sum"]), task.calls, hasattr(task, "last")))

    task = Stateful(10)
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    saturate.fit(
        lambda num_classes: nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes)),
        torch.utils.data.TensorDataset(x, y),
        torch.utils.data.TensorDataset(x[:16], y[:16]),
        task=task,
        callbacks=[Watch()],
        overrides=["trainer.max_epochs=1", "loader.batch_size=auto", "trainer.progress=false"],
        run_dir=tmp_path,
    )
    # the start-up check and the batch-size search's trials ran the task (its call counter, not a tensor, says
    # so): the state it holds in tensors is back as it was
    assert seen[0][:2] == ([0.0, 0.0, 0.0], 0.0) and seen[0][2] > 0 and seen[0][3] is False


def test_a_sequential_order_over_data_that_is_not_a_stream_is_refused(tmp_path):
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    with pytest.raises(UserError) as err:
        saturate.fit(
            lambda in_features, num_classes: nn.Linear(in_features, num_classes),
            torch.utils.data.TensorDataset(x, y),
            None,
            overrides=["loader.order=sequential", "loader.batch_size=8", "trainer.progress=false"],
            run_dir=tmp_path,
        )
    message = str(err.value)
    assert "loader.order=sequential" in message and "TensorDataset" in message and "stream = True" in message


def test_a_model_that_does_not_return_its_state_is_one_message(tmp_path):
    data = streams()
    with pytest.raises(UserError) as err:
        saturate.fit(
            lambda num_classes: nn.Sequential(nn.Embedding(num_classes, 4), nn.Linear(4, num_classes)),
            data["train"],
            data["val"],
            task=Classification(VOCAB, carry=True),
            overrides=[*LM[6:9], "trainer.progress=false"],
            run_dir=tmp_path,
        )
    assert "task.carry=true: Sequential.forward does not take a state" in str(err.value)
    assert "returns (outputs, state)" in str(err.value)


class Stateless(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.embed = nn.Embedding(num_classes, num_classes)

    def forward(self, x, state=None):
        return self.embed(x)


def test_a_model_that_takes_a_state_but_returns_none_is_one_message(tmp_path):
    data = streams()
    with pytest.raises(UserError) as err:
        saturate.fit(
            Stateless,
            data["train"],
            data["val"],
            task=Classification(VOCAB, carry=True),
            overrides=[*LM[6:9], "trainer.progress=false"],
            run_dir=tmp_path,
        )
    assert "task.carry=true: Stateless returned a Tensor; a model that carries a state returns (outputs, state)" in str(
        err.value
    )
