# ruff: noqa
# fmt: off
"""
Reference loop for saturate's `har` example: the public code it was ported from, with only its
data swapped for the example's.

PIN
  Repo    : https://github.com/mexeniz/har-lstm-mlflow   (MIT licence, (c) 2022 Pawissakan Chirupphapa)
  Commit  : ca9943618d282c21d495cc34492cc3e8d09df0d0 (HEAD, 2022-05-24); models.py last changed at
            f624468a8eff657d5c79c0bb2ea6a851697a443e, pl_data.py at 1eac9d9ab2f673bb06ec81dc7155b813b544c4bd,
            train_lstm.ipynb at ffbd1893d6d0eca404f5ab1cbc4b7b79a91709ee.
  Paths   : models.py        (HarLSTM; ModelUtils.train_net / calc_valid_loss / test_net: the loop)
            pl_data.py       (HarDataModule: its DataLoaders)
            train_lstm.ipynb ("Train LSTM Model Manually": the driver cells, copied below in order)
  The example's recipe (CrossEntropyLoss, Adam lr 1e-3, gradient norm clipped at 10) is these
  files' defaults: HarLSTM(lr=0.001), ModelUtils.train_net(clip=10). (train_lstm_mlflow.ipynb,
  the other driver, runs HarLSTM through Lightning's Trainer with MLflow; not this loop.)

CHANGED (and why)
  1. Data swap: HarDataModule.__init__ read UCI HAR's "Inertial Signals" text files
     (FeatUtils.load_dataset_group), split train 80/20 stratified into train/val and scaled
     them; here it takes the example's `examples.har.har.load_har()` splits (train 21 subjects,
     val 4, test 5; 128 x 9 windows, 6 activities) as TensorDatasets. The notebook's
     `normalize="std"` becomes `normalize=None` (the DataModule's own option): saturate feeds
     the example's windows unscaled, so the reference does too. The DataModule's
     train/val/test_dataloader methods are verbatim (num_workers=8, persistent_workers=True,
     pin_memory=True, drop_last=True for all three splits: the test split of 400 windows is
     evaluated on its first 384, as the author's loader does).
  2. Sizes, through the notebook's own variables: batch_size 16 -> 64, n_hidden 128 -> 64,
     epochs 50 -> 15, lr 0.0001 -> 0.001, clip=5 -> clip=10 (train_net's default), the
     example's values (experiment=har, model har_lstm n_hidden 64). print_every=100 kept.
  3. HarLSTM.forward: the two author bugs the example fixed are fixed here too, so both sides
     train the same model (the brief: like-for-like):
       - `out = self.dropout(lstm_out)` was computed and thrown away (`out = lstm_out[:, -1, :]`):
         now `out = out[:, -1, :]`, the dropped-out last step (the example: dropout on the
         last step; same distribution);
       - `out = self.softmax(out)` before nn.CrossEntropyLoss (which applies log-softmax
         itself) is removed: the loss gets logits.
     The author's lines are kept as comments. HarLSTM stays a pl.LightningModule (its import
     of pytorch_lightning is part of this reference's start-up, as in the author's code).
  4. `from loguru import logger` -> a stdlib logging logger with loguru's default look
     (loguru is not installed here); `import seaborn` and ModelUtils.plot_loss_chart (the only
     user of seaborn) removed with the notebook's plot cell; save/load_model_weight and the
     Lightning training/validation/test_step methods are unused by this loop but kept.
  5. The notebook's `torch.save(net, model_path)` / `torch.load(model_path)` round trip before
     testing is skipped: the same in-memory net is tested (torch >= 2.6 refuses to unpickle a
     whole module by default, and it is file I/O, not training).
  6. Instrumentation (no effect on training): `--seed` (the notebook seeds nothing; default 0
     seeds torch and numpy), `--target`; calc_valid_loss also counts correct predictions so
     every evaluation (every 100 steps and every epoch end, as train_net does them) prints the
     time since process start and the validation accuracy; the first optimizer step's time
     since process start; at the end the time the target was first reached and the test
     metrics the notebook computes (accuracy, macro precision/recall/F1), as `BENCH ...` lines.
     `--epochs` (default 15, the run above) shortens the run for scripts/bench_examples.py --quick.

Run (from the repository root, so that `examples.har` imports):
  PYTHONPATH=. python examples/har/reference.py [--seed 0] [--target 0.65] [--epochs 15]
  (or through scripts/bench_examples.py, which pairs it with saturate's run)

LICENCE (of the copied code; the instrumentation and CHANGED lines are saturate's)
  MIT License

  Copyright (c) 2022 Pawissakan Chirupphapa

  Permission is hereby granted, free of charge, to any person obtaining a copy
  of this software and associated documentation files (the "Software"), to deal
  in the Software without restriction, including without limitation the rights
  to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
  copies of the Software, and to permit persons to whom the Software is
  furnished to do so, subject to the following conditions:

  The above copyright notice and this permission notice shall be included in all
  copies or substantial portions of the Software.

  THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
  IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
  FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
  AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
  LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
  OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
  SOFTWARE.
"""

# --- instrumentation: seconds since this process started (kernel start time, /proc) -----
import os as _os
import time as _time


def _since_start() -> float:
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / _os.sysconf("SC_CLK_TCK")


_T0 = _time.time() - _since_start()
_first_step = []
_evals = []
_correct = []


def _elapsed() -> float:
    return _time.time() - _T0


import argparse as _argparse

_parser = _argparse.ArgumentParser()
_parser.add_argument("--seed", type=int, default=0)
_parser.add_argument("--target", type=float, default=0.65, help="validation accuracy (higher is better)")
_parser.add_argument("--epochs", type=int, default=15, help="instrumentation: the quick check's shorter run")
_args = _parser.parse_args()

# ============================ models.py (mexeniz/har-lstm-mlflow) ============================
import logging as _logging
import sys as _sys

_logging.basicConfig(stream=_sys.stderr, level=_logging.DEBUG,
                     format="%(asctime)s.%(msecs)03d | %(levelname)-8s | %(name)s - %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
logger = _logging.getLogger("models")  # CHANGED: from loguru import logger (loguru not installed)
import numpy as np
import pandas as pd
# import seaborn as sns  # CHANGED: removed with plot_loss_chart (seaborn not installed; plotting only)
import pytorch_lightning as pl
from sklearn.metrics import accuracy_score, precision_score, recall_score
import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset, DataLoader

class ModelUtils():
    
    # CHANGED: plot_loss_chart (seaborn) removed
    
    @staticmethod
    def calc_valid_loss(net, criterion, valid_loader, batch_size, use_gpu=False):
        """Run a model with valid_loader and calculate model loss.
        Call `net.train()` again after this function to resume training mode."""
        
        net.eval()
        val_losses = []
        _correct.clear()  # instrumentation
        for inputs, labels in valid_loader:
            if(use_gpu):
                inputs, labels = inputs.cuda(), labels.cuda()

            output = net(inputs)
            val_loss = criterion(output, labels)
            _correct.append(((output.argmax(1) == labels).sum().item(), len(labels)))  # instrumentation

            val_losses.append(val_loss.item())
        return val_losses

    @classmethod
    def train_net(cls, net, criterion, optimizer, train_loader, valid_loader, batch_size, epochs, use_gpu=False, print_every=100, clip=10):
        logger.info(f"Training a model: epochs={epochs} use_gpu={use_gpu} clip={clip}")
        train_stat_dict = {
            "epoch":[],
            "step":[],
            "loss":[],
            "val_loss":[]
        }
        counter = 0

        # move model to GPU, if available
        if(use_gpu):
            net.cuda()

        net.train()
        # train for some number of epochs
        for e in range(epochs):
            train_losses = []
            # batch loop
            for inputs, labels in train_loader:
                counter += 1

                if(use_gpu):
                    inputs, labels = inputs.cuda(), labels.cuda()

                # zero accumulated gradients
                net.zero_grad()

                # get the output from the model
                output = net(inputs)
                
                # calculate the loss and perform backprop
                loss = criterion(output, labels)
                loss.backward()
                # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
                nn.utils.clip_grad_norm_(net.parameters(), clip)
                optimizer.step()
                if not _first_step:  # instrumentation
                    _first_step.append(_elapsed())
                    print(f"BENCH first_step t={_first_step[0]:.3f}", flush=True)
                
                train_losses.append(loss.item())
                
                # Show loss stats every "print_every" batch
                if counter % print_every == 0:
                    val_losses = cls.calc_valid_loss(net, criterion, valid_loader, batch_size, use_gpu)
                    _eval(e + 1, counter, np.mean(val_losses))  # instrumentation
                    net.train()
                    logger.debug("epoch:{}/{} step={} train_loss={:.6f} val_loss={:.6f}".format(e+1, epochs, counter, np.mean(train_losses), np.mean(val_losses)))
            
            # End of epoch
            val_losses = cls.calc_valid_loss(net, criterion, valid_loader, batch_size, use_gpu)
            _eval(e + 1, counter, np.mean(val_losses))  # instrumentation
            net.train()
            train_stat_dict["epoch"].append(e+1)
            train_stat_dict["step"].append(counter)
            train_stat_dict["loss"].append(np.mean(train_losses))
            train_stat_dict["val_loss"].append(np.mean(val_losses))

        return train_stat_dict

    @staticmethod
    def test_net(net, criterion, test_loader, batch_size, use_gpu=False):
        logger.info(f"Testing a model: use_gpu={use_gpu}")
        # Get test data loss and accuracy
        
        test_losses = [] # track loss
        preds = []
        true_labels = []

        if(use_gpu):
            net.cuda()
        
        net.eval()
        # iterate over test data
        for inputs, labels in test_loader:
            if(use_gpu):
                inputs, labels = inputs.cuda(), labels.cuda()

            # get predicted outputs
            output = net(inputs)
            
            # calculate loss
            test_loss = criterion(output, labels)

            # get the predicted class by the highest probabilty
            top_p, pred = output.topk(1, dim=1)
            
            if use_gpu:
                # Move back GPU's memory to CPU's memory to compute score
                labels = labels.cpu().tolist()
                pred = pred.cpu().flatten().tolist()
            else:
                labels = labels.tolist()
                pred = pred.flatten().tolist()
            
            test_losses.append(test_loss.item())
            preds.extend(pred)
            true_labels.extend(labels)
            


        # -- stats! -- ##
        # avg test loss
        avg_loss = np.mean(test_losses)
        logger.info("Test loss: {:.3f}".format(avg_loss))
        
        return avg_loss, true_labels, preds
    
    @staticmethod
    def save_model_weight(net, model_path):
        logger.info(f"Saving model weight: path={model_path}")
        torch.save(net.state_dict(), model_path)
    
    @staticmethod
    def load_model_weight(net, model_path):
        logger.info(f"Loading model weight: path={model_path}")
        net.load_state_dict(torch.load(model_path))
        return net

class HarLSTM(pl.LightningModule):
    
    def __init__(self, input_size, output_size, n_hidden=256, n_layers=2,
                               drop_prob=0.5, lr=0.001):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.drop_prob = drop_prob
        self.n_layers = n_layers
        self.n_hidden = n_hidden
        self.lr = lr
        
        self.lstm = nn.LSTM(input_size, n_hidden, n_layers, 
                            dropout=drop_prob, batch_first=True)
        self.dropout = nn.Dropout(p=drop_prob)
        self.fc = nn.Linear(n_hidden, self.output_size)
        self.softmax = nn.Softmax(dim=1)

        self.criterion = nn.CrossEntropyLoss()
        
    def training_step(self, batch, batch_idx):
        return self._common_step(batch, batch_idx, "train")
    
    def validation_step(self, batch, batch_idx):
        return self._common_step(batch, batch_idx, "valid")
    
    def test_step(self, batch, batch_idx):
        return self._common_step(batch, batch_idx, "test")
    
    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        x, _ = self._prepare_batch(batch)
        return self(x)
    
    def _common_step(self, batch, batch_idx, stage: str):
        x, labels = self._prepare_batch(batch)
        loss = self.criterion(self(x), labels)
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss
    
    def _prepare_batch(self, batch):
        # Ignore label
        x, labels = batch
        # Input shape should be (batch_size, seq_length, input_size)
        return x.view(x.size(0), -1, self.input_size), labels
    
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)
    
    def forward(self, x):
        lstm_out, _ = self.lstm(x)
        
        out = self.dropout(lstm_out)
        # getting the last time step output
        out = out[:, -1, :]  # FIXED (as the example): author `out = lstm_out[:, -1, :]` threw the dropout away
        
        # you may need to use contiguous to reshape the output
        out = out.contiguous().view(-1, self.n_hidden)
        out = self.fc(out)
        # out = self.softmax(out)  # FIXED (as the example): no softmax before nn.CrossEntropyLoss
    
        return out

# ============================ pl_data.py (mexeniz/har-lstm-mlflow) ============================
class HarDataModule(pl.LightningDataModule):
    
    def __init__(self, data_dir_path: str, num_workers: int=8, feat_shape=(128, 9), batch_size: int=64,
                 train_val_ratio=0.8, simple_loader: bool = False, normalize="minmax", scaler=None):
        super().__init__()
        
        self.data_dir_path = data_dir_path
        self.train_val_ratio = train_val_ratio
        self.num_workers = num_workers # For DataLoader parameter
        self.feat_shape = feat_shape
        self.batch_size = batch_size
        self.simple_loader = simple_loader

        # CHANGED (data swap): UCI HAR files, the 80/20 stratified train/val split and the
        # scaler replaced by the example's splits (normalize=None: no scaler, see docstring)
        from examples.har.har import load_har
        splits = load_har()
        self.scaler = None
        self.train_data = TensorDataset(splits["train"].windows, splits["train"].labels)
        self.val_data = TensorDataset(splits["val"].windows, splits["val"].labels)
        self.test_data = TensorDataset(splits["test"].windows, splits["test"].labels)
    
    def get_scaler(self):
        return self.scaler
    
    def train_dataloader(self):
        # Only train_loader's shuffle should be turned on.
        if self.simple_loader:
            return DataLoader(self.train_data, shuffle=True, batch_size=self.batch_size, drop_last=True)
        else:
            return DataLoader(self.train_data, shuffle=True, num_workers=self.num_workers, 
                              persistent_workers=True, pin_memory=True, batch_size=self.batch_size, drop_last=True)

    def val_dataloader(self):
        if self.simple_loader:
            return DataLoader(self.val_data, shuffle=False, batch_size=self.batch_size, drop_last=True)
        else:
            return DataLoader(self.val_data, shuffle=False, num_workers=self.num_workers, 
                              persistent_workers=True, pin_memory=True, batch_size=self.batch_size, drop_last=True)

    def test_dataloader(self):
        if self.simple_loader:
            return DataLoader(self.test_data, shuffle=False, batch_size=self.batch_size, drop_last=True)
        else:
            return DataLoader(self.test_data, shuffle=False, num_workers=self.num_workers,
                          persistent_workers=True, pin_memory=True, batch_size=self.batch_size, drop_last=True)

    def predict_dataloader(self):
        return DataLoader(self.test_data, shuffle=False, num_workers=self.num_workers,
                          persistent_workers=True, pin_memory=True, batch_size=self.batch_size, drop_last=True)


def _eval(epoch, step, val_loss):  # instrumentation: one evaluation's time and accuracy
    right, seen = map(sum, zip(*_correct))
    _evals.append((_elapsed(), epoch, step, right / seen))
    print(f"BENCH eval t={_evals[-1][0]:.3f} epoch={epoch} step={step} val_acc={right / seen:.4f} val_loss={val_loss:.5f}", flush=True)


# ======================= train_lstm.ipynb ("Train LSTM Model Manually") =======================
if __name__ == "__main__":
    torch.manual_seed(_args.seed)  # CHANGED: the notebook seeds nothing (--seed)
    np.random.seed(_args.seed)

    from sklearn.metrics import accuracy_score, precision_recall_fscore_support

    # 1. Prepare features
    data_dir_path = "./data/har_dataset"
    norm_method = None  # CHANGED: "std" (see docstring, 1.)
    batch_size = 64  # CHANGED: 16 (the example's loader.batch_size)
    data_module = HarDataModule(data_dir_path, 
                                batch_size=batch_size,
                               normalize=norm_method)

    # 2. Define model structure and parameters
    # Check if GPU is available
    use_gpu = torch.cuda.is_available()
    if(use_gpu):
        print('Training on GPU!')
    else: 
        print('No GPU available, training on CPU; consider making n_epochs very small.')

    # Instantiate the model with hyperparams
    input_size = 9
    output_size = 6
    n_hidden = 64  # CHANGED: 128 (the example's model.n_hidden)
    n_layers = 2

    # Training params
    epochs = _args.epochs  # CHANGED: 50 -> 15 (the example's trainer.max_epochs; --epochs, default 15)
    lr = 0.001  # CHANGED: 0.0001 (the example's optim lr; HarLSTM's own default)

    net = HarLSTM(input_size, output_size, n_hidden=n_hidden, n_layers=n_layers)

    print("Model information:")
    print(net)

    # Define loss and optimization functions
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)

    # 3. Train the model
    train_loader = data_module.train_dataloader()
    val_loader = data_module.val_dataloader()
    train_stat_dict = ModelUtils.train_net(net, criterion, optimizer, train_loader, val_loader, batch_size, epochs, 
                                use_gpu=use_gpu, print_every=100, clip=10)  # CHANGED: clip=5 (the example's grad_clip 10, train_net's default)

    # CHANGED: ModelUtils.plot_loss_chart(train_stat_dict) and the torch.save / torch.load round trip skipped
    loaded_net = net

    # 4. Test inference by a loaded model
    test_loader = data_module.test_dataloader()
    test_loss, test_labels, preds = ModelUtils.test_net(loaded_net, loaded_net.criterion, test_loader, batch_size, use_gpu=use_gpu)

    acc = accuracy_score(test_labels, preds)
    prec, recall, f1, _ = precision_recall_fscore_support(test_labels, preds, average="macro")

    print(f"accuracy: {acc}")
    print(f"precision: {prec}")
    print(f"recall: {recall}")
    print(f"f1: {f1}")

    # --- instrumentation: the run's figures for the benchmark ----------------------------
    _hit = next((e for e in _evals if e[3] >= _args.target), None)
    print(f"BENCH target val_acc>={_args.target} " + (f"t={_hit[0]:.3f} epoch={_hit[1]} step={_hit[2]}" if _hit else "t=nan epoch=none"))
    _ends = [e for e in _evals]
    print(f"BENCH final test_acc={acc:.4f} test_f1_macro={f1:.4f} test_n={len(test_labels)} last_val_acc={_evals[-1][3]:.4f} "
          f"best_val_acc={max(e[3] for e in _evals):.4f} evals={len(_evals)} t_end={_elapsed():.3f}", flush=True)
