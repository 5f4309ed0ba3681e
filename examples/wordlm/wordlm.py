"""A word-level LSTM language model, trained as `pytorch/examples`' word_language_model/main.py
trains one (BSD-3, (c) 2017 Pytorch contributors; RNNModel copied below). What its loop does,
and where it lives here:

- data.py's Corpus: words split on whitespace, `<eos>` after each line, a dictionary of the
  words of every split in the order met (Wikitext-2's train, valid, test files)
                                        -> `load_words`: Python's own documentation topics
                                           (`pydoc_data.topics`, sorted by name, joined: no
                                           download), the first 90% of its characters to
                                           train on, the rest to validate on; 8,8xx words, no
                                           cap needed
- batchify(data, 20): 20 streams of consecutive words; get_batch: the next bptt (35) words of
  every stream, the words after them as targets
                                        -> `TokenWindows` (`stream = True`: sample i is words
                                           [i*35, (i+1)*35)) with loader.order=sequential:
                                           batch k holds window k of each of the 20 streams
- the hidden state carried from batch to batch (repackage_hidden: detached), zeros at the
  start of each epoch and of each evaluation
                                        -> task.carry=true: the model is called as
                                           model(input, hidden), hidden None at the start of
                                           each pass (nn.LSTM's zeros), detached between
                                           batches
- evaluate() with eval_batch_size 10  -> loader.eval_batch_size=10
- RNNModel, time-major (seq_len, batch), returning (seq_len*batch, ntoken) log-probabilities;
  nn.NLLLoss                          -> `BatchFirst` around it: (B, T) in, (B, T, ntoken) out
                                           (the only lines that change); task=classification
                                           with task.loss: `nll_loss`, the author's NLLLoss
                                           (the task's own cross-entropy would give the same
                                           loss through one more log_softmax over 8,832
                                           words: 25 ms of a 58 ms step here); no val/acc
                                           (task.metrics: acc null) and task.top_k=0: no
                                           val/top5 of 8,832 words, which the author's loop
                                           does not compute
- `p.data.add_(p.grad, alpha=-lr)` at lr 20, clip_grad_norm_ 0.25
                                        -> optim=custom (torch.optim.SGD, lr 20, no momentum),
                                           trainer.grad_clip=0.25, optim.warmup_epochs=0
- `lr /= 4.0` after an epoch whose validation loss is no better than the best so far
                                        -> optim.scheduler: ReduceLROnPlateau(factor 0.25,
                                           patience 0, threshold 0) fed val/loss after each
                                           epoch (checkpoint.monitor)
- the model saved when val improves, the test set evaluated with it
                                        -> best.pt (by val/loss)

Sizes scaled to a 2-core CPU: emsize = nhid = 64, 2 layers, dropout 0.2, 10 epochs (the
author's 200, 200, 40).
Target (scripts/bench_examples.py): val/loss <= 6.1 (nats per word; perplexity 446), met by the
reference after epochs 6 and 5 with seeds 1 and 2, and by this port after epoch 8 with seed 1.
"""

from __future__ import annotations

import io

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset


def corpus() -> str:
    """Python's documentation topics (shipped with every Python), sorted by name and joined:
    about 465,000 characters, 77,000 words of English."""
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics))


class Dictionary:
    """data.py's Dictionary: each word's index in the order the words are first met."""

    def __init__(self):
        self.word2idx: dict[str, int] = {}
        self.idx2word: list[str] = []

    def add_word(self, word: str) -> int:
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self) -> int:
        return len(self.idx2word)


def tokenize(text: str, dictionary: Dictionary) -> torch.Tensor:
    """data.py's Corpus.tokenize on a string: each line's words and `<eos>`, added to the
    dictionary, as int64 indices."""
    ids = [dictionary.add_word(word) for line in io.StringIO(text) for word in line.split() + ["<eos>"]]
    return torch.tensor(ids, dtype=torch.int64)


def encode_words(text: str | None = None) -> tuple[Dictionary, torch.Tensor, torch.Tensor]:
    """(dictionary, train ids, val ids): the text's first 90% of characters to train on (as
    nanoGPT's prepare.py splits), the rest to validate on, tokenized in that order."""
    text = corpus() if text is None else text
    n = int(len(text) * 0.9)
    dictionary = Dictionary()
    train = tokenize(text[:n], dictionary)
    return dictionary, train, tokenize(text[n:], dictionary)


class TokenWindows(Dataset):
    """Consecutive windows of bptt words: sample i is (words [i*bptt, (i+1)*bptt), the word
    after each). `stream = True`: sample i + 1 follows sample i (loader.order=sequential)."""

    stream = True

    def __init__(self, ids: torch.Tensor, bptt: int, words: list[str]):
        self.ids, self.bptt, self.classes = ids, bptt, words

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.bptt

    def __getitem__(self, i: int):
        start = i * self.bptt
        return self.ids[start : start + self.bptt], self.ids[start + 1 : start + 1 + self.bptt]


def load_words(bptt: int = 35) -> dict:
    dictionary, train, val = encode_words()
    words = dictionary.idx2word
    return {"train": TokenWindows(train, bptt, words), "val": TokenWindows(val, bptt, words)}


# ------------------------------------------------- word_language_model/model.py (BSD-3)
# RNNModel copied from pytorch/examples at 77f55b9 (word_language_model last changed at
# 28d16ff) as written.


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super(RNNModel, self).__init__()  # noqa: UP008 (as written)
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        if rnn_type in ["LSTM", "GRU"]:
            self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        else:
            try:
                nonlinearity = {"RNN_TANH": "tanh", "RNN_RELU": "relu"}[rnn_type]
            except KeyError as e:
                raise ValueError(
                    """An invalid option for `--model` was supplied,
                                 options are ['LSTM', 'GRU', 'RNN_TANH' or 'RNN_RELU']"""
                ) from e
            self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=nonlinearity, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)

        # Optionally tie weights as in:
        # "Using the Output Embedding to Improve Language Models" (Press & Wolf 2016)
        # https://arxiv.org/abs/1608.05859
        # and
        # "Tying Word Vectors and Word Classifiers: A Loss Framework for Language Modeling" (Inan et al. 2016)
        # https://arxiv.org/abs/1611.01462
        if tie_weights:
            if nhid != ninp:
                raise ValueError("When using the tied flag, nhid must be equal to emsize")
            self.decoder.weight = self.encoder.weight

        self.init_weights()

        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))
        else:
            return weight.new_zeros(self.nlayers, bsz, self.nhid)


class BatchFirst(nn.Module):
    """The author's RNNModel with batch-first tensors: input (B, T) is fed to it as (T, B); its
    (T*B, ntoken) log-probabilities come back as (B, T, ntoken), a class per position. The
    hidden state passes through as it is (None: the LSTM's zeros)."""

    def __init__(self, model: RNNModel):
        super().__init__()
        self.model = model

    def forward(self, input: torch.Tensor, hidden=None):
        output, hidden = self.model(input.t(), hidden)
        return output.view(input.shape[1], input.shape[0], -1).transpose(0, 1), hidden


def nll_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """task.loss: main.py's `criterion = nn.NLLLoss()` on the (B, T, ntoken) log-probabilities
    and (B, T) next words, flattened as the author's model and get_batch flatten them."""
    return F.nll_loss(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def language_model(
    ntoken: int, rnn_type: str = "LSTM", emsize: int = 64, nhid: int = 64, nlayers: int = 2, dropout: float = 0.2
) -> BatchFirst:
    """main.py's `RNNModel(args.model, ntokens, args.emsize, args.nhid, args.nlayers,
    args.dropout, args.tied)`, batch-first."""
    return BatchFirst(RNNModel(rnn_type, ntoken, emsize, nhid, nlayers, dropout))
