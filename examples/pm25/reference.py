# ruff: noqa
# fmt: off
"""
Reference loop for saturate's `pm25` example: the public script it was ported from, with its
data reading swapped for the example's data and the parts after the basic model's training
left out.

PIN
  Repo    : https://github.com/Bostoncool/something   (MIT licence, (c) 2024 Bostoncool)
  Commit  : bf56a839cc13626d8c134a88ae30b20e45cd162f ("phase 4.2", 2025-10-16), the commit at which
            the script is the English CPU version copied here (56,231 characters, Parts 1-16). It
            was added in Chinese at 5d53e6360544edea7851706067c8a5a7819185e7 and deleted at
            0d2dc8aecb45fd6ac76647fc5e2723c02395d92b: cite it at bf56a83, not at the newest commit.
  Path    : Short-essay-Beijing/DeepLearning/CNN/CNN-CPU.py ("Beijing PM2.5 Concentration
            Prediction - 2D CNN Model", `BATCH_SIZE = 32`, `DEVICE = torch.device('cpu')  # CPU
            version`; pollution from the Benchmark CSVs, ERA5 from CSV files under
            'ERA5-Beijing-CSV'). Its GPU sibling is DeepLearning/CNN/CNN-GPU.py.
  Used    : Part 1 (configuration), Part 6 (TimeSeriesDataset, split, DataLoaders), Part 7
            (PM25CNN2D), Part 8 (train_epoch, validate, train_model, evaluate_model), Part 9 (the
            basic model: MSE, Adam 1e-3, 200 epochs, early stopping patience 20, evaluation in
            µg/m³).
  Checked : every line not marked "# CHANGED" below is the script's at bf56a83, in its order (a
            line-by-line diff against `git show bf56a83:Short-essay-Beijing/DeepLearning/CNN/CNN-CPU.py`).

CHANGED (and why; each line is marked "# CHANGED" below)
  1. Data swap: Parts 2-5 deleted (reading the Benchmark pollution CSVs and the ERA5 CSVs,
     feature engineering, the scalers fitted on all days, the sliding windows). In their place
     `examples.pm25.pm25.load_pm25(window_size=30)` (the same 30-day windows and last-day target,
     70/15/15 split in time order, scalers fitted on the training days): its train, val and test
     `Windows` are stacked into the arrays X_train, y_train, X_val, y_val, X_test, y_test that
     the author's TimeSeriesDataset takes, and `scaler_y.inverse_transform(a)` is a three-line
     shim around the example's `target_inverse`. Part 6's split lines (and its per-split date
     ranges: the example's windows carry no dates) go with Part 5's arrays.
  2. train_loader = DataLoader(..., drop_last=True) (the author's default is False): the
     example's 1,249 training windows leave a last batch of one, which crashes BatchNorm1d in
     training mode. saturate drops the last training batch too. Validation and test keep
     drop_last=False.
  3. Parts 10-16 left out (hyper-parameter search, the optimized model, the comparison, feature
     importance, figures, CSV/.pth/pickle outputs, the summary report that reads them), and their
     imports (matplotlib with its rcParams lines, bayes_opt, glob, pickle): the example ports the
     basic model's training only.
  4. Kept as the author wrote it: `return x.squeeze()` in the model (no batch of one reaches it
     after 2.), and `best_model_state = model.state_dict().copy()`, a shallow copy (the tensors
     are the model's own), so the "restored best model" is the last epoch's (saturate tests
     best.pt). The unused imports the author's kept parts carry (ThreadPoolExecutor, tqdm,
     train_test_split, StandardScaler) and Part 1's paths and variable lists are kept too.
  5. Instrumentation (no effect on training): the hard-coded seed 42 -> --seed (default 42);
     --target (validation RMSE in µg/m³, lower is better); --epochs (basic_params'
     num_epochs, default 200, for the bench's --quick); `BENCH first_step` after the first
     optimizer.step(), `BENCH eval ... val_rmse_raw=` after every validation (the validation
     predictions taken back to µg/m³ through the shim), `BENCH target` and `BENCH final
     test_rmse_raw=...` at the end, in seconds since the process started (from /proc/self/stat).

Run (PYTHONPATH = saturate's repository root, so that `examples.pm25` imports; it makes ./output
and ./models in the working directory, as the author's does: run it from a scratch folder):
  PYTHONPATH=/path/to/saturate python /path/to/saturate/examples/pm25/reference.py --target 40 [--seed 42] [--epochs 200]

LICENCE (of the copied code; the CHANGED and instrumentation lines are saturate's)
  MIT License

  Copyright (c) 2024 Bostoncool

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
import os
import time


def _process_start_wall():  # CHANGED: instrumentation
    """time.time() at the moment this process was created (from /proc, 10 ms resolution)."""
    try:
        with open('/proc/self/stat') as f:
            start_ticks = float(f.read().rsplit(')', 1)[1].split()[19])
        with open('/proc/uptime') as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf('SC_CLK_TCK'))
    except Exception:
        return time.time()


T0 = _process_start_wall()  # CHANGED: instrumentation

"""
Beijing PM2.5 Concentration Prediction - 2D CNN Model
Using 2D Convolutional Neural Network for time series prediction

Features:
- 2D CNN architecture, treating time window and features as 2D images
- Uses 30 days of historical data to predict current day PM2.5 concentration
- Supports hyperparameter optimization (Bayesian optimization)
- Gradient×Input method for feature importance analysis
- Complete model evaluation and visualization

Data Sources:
- Pollution data: Benchmark dataset (PM2.5, PM10, SO2, NO2, CO, O3)
- Meteorological data: ERA5 reanalysis data
"""

import argparse  # CHANGED: instrumentation
import os
import pandas as pd
import numpy as np
# CHANGED: `import matplotlib.pyplot as plt` dropped (Parts 13-14)
from datetime import datetime, timedelta
from concurrent.futures import ThreadPoolExecutor, as_completed
import warnings
# CHANGED: `import pickle` dropped (Part 15)
from pathlib import Path
# CHANGED: `import glob` dropped (Part 2)
import multiprocessing

warnings.filterwarnings('ignore')

# PyTorch related
import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import Dataset, DataLoader

from examples.pm25.pm25 import load_pm25  # CHANGED: the example's data (replaces Parts 2-5)

# Get CPU core count
CPU_COUNT = multiprocessing.cpu_count()
MAX_WORKERS = max(4, CPU_COUNT - 1)

# Try to import tqdm progress bar
try:
    from tqdm import tqdm
    TQDM_AVAILABLE = True
except ImportError:
    TQDM_AVAILABLE = False
    print("Note: tqdm not installed, progress display will use simplified version.")
    print("      Use 'pip install tqdm' to get better progress bar display.")

# Machine learning libraries
from sklearn.model_selection import train_test_split
from sklearn.metrics import mean_squared_error, r2_score, mean_absolute_error
from sklearn.preprocessing import StandardScaler

# CHANGED: the bayes_opt import (try/except, BAYESIAN_OPT_AVAILABLE) dropped (Part 10)

# CHANGED: the three plt.rcParams lines (English fonts, dpi) dropped with matplotlib

# CHANGED: instrumentation, the bench's flags (next 5 lines)
parser = argparse.ArgumentParser()
parser.add_argument('--seed', type=int, default=42, help='replaces the hard-coded seed 42')
parser.add_argument('--target', type=float, default=40.0, help='validation RMSE (µg/m³) for the time to target (the bench)')
parser.add_argument('--epochs', type=int, default=200, help="the basic model's num_epochs")
args = parser.parse_args()

# Set random seed
np.random.seed(args.seed)  # CHANGED: 42
torch.manual_seed(args.seed)  # CHANGED: 42
if torch.cuda.is_available():
    torch.cuda.manual_seed(args.seed)  # CHANGED: 42

_EVALS = []  # CHANGED: instrumentation, (t, epoch, val_rmse_raw)
_FIRST = []  # CHANGED: instrumentation, the first optimizer step's time

print("=" * 80)
print("Beijing PM2.5 Concentration Prediction - 2D CNN Model")
print("=" * 80)

# ============================== Part 1: Configuration and Path Setup ==============================
print("\nConfiguring parameters...")

# Data paths
pollution_all_path = r'C:\Users\IU\Desktop\Datebase Origin\Benchmark\all(AQI+PM2.5+PM10)'
pollution_extra_path = r'C:\Users\IU\Desktop\Datebase Origin\Benchmark\extra(SO2+NO2+CO+O3)'
era5_path = r'C:\Users\IU\Desktop\Datebase Origin\ERA5-Beijing-CSV'

# Output path
output_dir = Path('./output')
output_dir.mkdir(exist_ok=True)

# Model save path
model_dir = Path('./models')
model_dir.mkdir(exist_ok=True)

# Date range
start_date = datetime(2015, 1, 1)
end_date = datetime(2024, 12, 31)

# Beijing geographic range
beijing_lats = np.arange(39.0, 41.25, 0.25)
beijing_lons = np.arange(115.0, 117.25, 0.25)

# Pollutant list
pollutants = ['PM2.5', 'PM10', 'SO2', 'NO2', 'CO', 'O3']

# ERA5 variables
era5_vars = [
    'd2m', 't2m', 'u10', 'v10', 'u100', 'v100',  # Temperature, wind speed
    'blh', 'sp', 'tcwv',  # Boundary layer height, pressure, water vapor
    'tp', 'avg_tprate',  # Precipitation
    'tisr', 'str',  # Radiation
    'cvh', 'cvl',  # Cloud cover
    'mn2t', 'sd', 'lsm'  # Others
]

# CNN specific parameters
WINDOW_SIZE = 30  # Use past 30 days data
BATCH_SIZE = 32
DEVICE = torch.device('cpu')  # CPU version

print(f"Data time range: {start_date.date()} to {end_date.date()}")
print(f"Target variable: PM2.5 concentration")
print(f"Time window size: {WINDOW_SIZE} days")
print(f"Batch size: {BATCH_SIZE}")
print(f"Device: {DEVICE}")
print(f"Output directory: {output_dir}")
print(f"Model save directory: {model_dir}")
print(f"CPU cores: {CPU_COUNT}, parallel workers: {MAX_WORKERS}")

# ============================== Parts 2-5: the example's data ==============================
# CHANGED: Parts 2-5 (Benchmark and ERA5 reading, feature engineering, scalers fitted on all days,
# sliding windows) -> the example's windows, stacked into the arrays Part 6 takes
print("\n" + "=" * 80)  # CHANGED
print("Steps 1-2: the example's data (examples.pm25.pm25.load_pm25)")  # CHANGED
print("=" * 80)  # CHANGED

_pm25 = load_pm25(window_size=WINDOW_SIZE)  # CHANGED

def _stack(windows):  # CHANGED: a split's Windows -> (X [num_windows, window_size, features], y [num_windows])
    pairs = [windows[i] for i in range(len(windows))]  # CHANGED
    return torch.stack([p[0] for p in pairs]).numpy(), torch.stack([p[1] for p in pairs]).numpy()  # CHANGED

X_train, y_train = _stack(_pm25['train'])  # CHANGED
X_val, y_val = _stack(_pm25['val'])  # CHANGED
X_test, y_test = _stack(_pm25['test'])  # CHANGED

class _TargetScaler:  # CHANGED: the shim: scaler_y.inverse_transform(a) -> the example's target_inverse
    def inverse_transform(self, a):  # CHANGED
        return _pm25['target_inverse'](torch.from_numpy(np.asarray(a, dtype=np.float64))).numpy()  # CHANGED

scaler_y = _TargetScaler()  # CHANGED

# ============================== Part 6: PyTorch Dataset and DataLoader ==============================
print("\n" + "=" * 80)
print("Step 3: Creating PyTorch Dataset")
print("=" * 80)

class TimeSeriesDataset(Dataset):
    """Time series dataset"""
    def __init__(self, X, y):
        self.X = torch.FloatTensor(X)
        self.y = torch.FloatTensor(y)
    
    def __len__(self):
        return len(self.X)
    
    def __getitem__(self, idx):
        return self.X[idx], self.y[idx]

# Split by time order: 70% training, 15% validation, 15% test
# CHANGED: the split of X_windows / y_windows (train_size, val_size) is the example's (above)
n_samples = len(X_train) + len(X_val) + len(X_test)  # CHANGED: was len(X_windows)

print(f"\nTraining set: {len(X_train)} samples ({len(X_train)/n_samples*100:.1f}%)")
# CHANGED: the time-range line dropped (no date_index: the example's windows carry no dates)

print(f"\nValidation set: {len(X_val)} samples ({len(X_val)/n_samples*100:.1f}%)")
# CHANGED: the time-range line dropped

print(f"\nTest set: {len(X_test)} samples ({len(X_test)/n_samples*100:.1f}%)")
# CHANGED: the time-range line dropped

# Create datasets and data loaders
train_dataset = TimeSeriesDataset(X_train, y_train)
val_dataset = TimeSeriesDataset(X_val, y_val)
test_dataset = TimeSeriesDataset(X_test, y_test)

train_loader = DataLoader(train_dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=0, drop_last=True)  # CHANGED: drop_last=True (a last batch of one crashes BatchNorm1d)
val_loader = DataLoader(val_dataset, batch_size=BATCH_SIZE, shuffle=False, num_workers=0)
test_loader = DataLoader(test_dataset, batch_size=BATCH_SIZE, shuffle=False, num_workers=0)

print(f"\nData loaders created:")
print(f"  Training batches: {len(train_loader)}")
print(f"  Validation batches: {len(val_loader)}")
print(f"  Test batches: {len(test_loader)}")

# ============================== Part 7: 2D CNN Model Definition ==============================
print("\n" + "=" * 80)
print("Step 4: Defining 2D CNN Model")
print("=" * 80)

class PM25CNN2D(nn.Module):
    """
    2D CNN model for PM2.5 prediction
    Input: [batch, 1, window_size, num_features] 
    Output: [batch] (single PM2.5 value)
    """
    def __init__(self, window_size, num_features, num_conv_layers=3, 
                 base_filters=32, kernel_size=3, dropout_rate=0.3):
        super(PM25CNN2D, self).__init__()
        
        self.window_size = window_size
        self.num_features = num_features
        
        # Convolutional layers
        conv_layers = []
        in_channels = 1
        
        for i in range(num_conv_layers):
            out_channels = base_filters * (2 ** i)
            conv_layers.extend([
                nn.Conv2d(in_channels, out_channels, kernel_size=kernel_size, padding=kernel_size//2),
                nn.BatchNorm2d(out_channels),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(kernel_size=2, stride=2)
            ])
            in_channels = out_channels
        
        self.conv_layers = nn.Sequential(*conv_layers)
        
        # Calculate feature map size after convolution
        self.feature_size = self._get_conv_output_size()
        
        # Fully connected layers
        self.fc_layers = nn.Sequential(
            nn.Linear(self.feature_size, 256),
            nn.BatchNorm1d(256),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout_rate),
            
            nn.Linear(256, 64),
            nn.BatchNorm1d(64),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout_rate * 0.7),
            
            nn.Linear(64, 1)
        )
        
        # Weight initialization
        self._initialize_weights()
    
    def _get_conv_output_size(self):
        """Calculate feature size after convolutional layers"""
        with torch.no_grad():
            dummy_input = torch.zeros(1, 1, self.window_size, self.num_features)
            dummy_output = self.conv_layers(dummy_input)
            return int(np.prod(dummy_output.shape[1:]))
    
    def _initialize_weights(self):
        """Initialize weights"""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.BatchNorm2d) or isinstance(m, nn.BatchNorm1d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)
    
    def forward(self, x):
        # x: [batch, window_size, num_features]
        # Add channel dimension
        x = x.unsqueeze(1)  # [batch, 1, window_size, num_features]
        
        # Convolutional layers
        x = self.conv_layers(x)
        
        # Flatten
        x = x.view(x.size(0), -1)
        
        # Fully connected layers
        x = self.fc_layers(x)
        
        return x.squeeze()

num_features = X_train.shape[2]
print(f"\nModel input dimensions:")
print(f"  Window size: {WINDOW_SIZE}")
print(f"  Number of features: {num_features}")

# ============================== Part 8: Training and Evaluation Functions ==============================
def train_epoch(model, dataloader, criterion, optimizer, device):
    """Train one epoch"""
    model.train()
    total_loss = 0
    
    for X_batch, y_batch in dataloader:
        X_batch = X_batch.to(device)
        y_batch = y_batch.to(device)
        
        optimizer.zero_grad()
        y_pred = model(X_batch)
        loss = criterion(y_pred, y_batch)
        loss.backward()
        optimizer.step()
        if not _FIRST:  # CHANGED: instrumentation
            _FIRST.append(time.time() - T0)  # CHANGED
            print(f"BENCH first_step t={_FIRST[0]:.3f}", flush=True)  # CHANGED
        
        total_loss += loss.item() * len(X_batch)
    
    return total_loss / len(dataloader.dataset)

def validate(model, dataloader, criterion, device):
    """Validate model"""
    model.eval()
    total_loss = 0
    predictions = []
    actuals = []
    
    with torch.no_grad():
        for X_batch, y_batch in dataloader:
            X_batch = X_batch.to(device)
            y_batch = y_batch.to(device)
            
            y_pred = model(X_batch)
            loss = criterion(y_pred, y_batch)
            
            total_loss += loss.item() * len(X_batch)
            predictions.extend(y_pred.cpu().numpy())
            actuals.extend(y_batch.cpu().numpy())
    
    avg_loss = total_loss / len(dataloader.dataset)
    predictions = np.array(predictions)
    actuals = np.array(actuals)
    
    return avg_loss, predictions, actuals

def train_model(model, train_loader, val_loader, criterion, optimizer, 
                num_epochs, device, patience=20, verbose=True):
    """Train model (with early stopping)"""
    train_losses = []
    val_losses = []
    best_val_loss = float('inf')
    patience_counter = 0
    best_model_state = None
    best_epoch = 0
    
    print(f"\nStarting training for {num_epochs} epochs...")
    
    for epoch in range(num_epochs):
        train_loss = train_epoch(model, train_loader, criterion, optimizer, device)
        val_loss, _val_pred, _val_true = validate(model, val_loader, criterion, device)  # CHANGED: instrumentation (was `val_loss, _, _`)
        # CHANGED: instrumentation (next 5 lines): the validation RMSE in µg/m³
        _rmse_raw = float(np.sqrt(mean_squared_error(scaler_y.inverse_transform(_val_true.reshape(-1, 1)).flatten(),
                                                      scaler_y.inverse_transform(_val_pred.reshape(-1, 1)).flatten())))
        _t = time.time() - T0
        _EVALS.append((_t, epoch + 1, _rmse_raw))
        print(f"BENCH eval t={_t:.3f} epoch={epoch + 1} val_rmse_raw={_rmse_raw:.4f} val_loss={val_loss:.5f}", flush=True)
        
        train_losses.append(train_loss)
        val_losses.append(val_loss)
        
        if verbose and (epoch + 1) % 10 == 0:
            print(f"Epoch {epoch+1}/{num_epochs} - Train Loss: {train_loss:.4f}, Val Loss: {val_loss:.4f}")
        
        # Early stopping check
        if val_loss < best_val_loss:
            best_val_loss = val_loss
            best_model_state = model.state_dict().copy()
            best_epoch = epoch + 1
            patience_counter = 0
        else:
            patience_counter += 1
        
        if patience_counter >= patience:
            print(f"\nEarly stopping triggered at epoch {epoch+1}")
            break
    
    # Restore best model
    if best_model_state is not None:
        model.load_state_dict(best_model_state)
    
    print(f"Training complete! Best model at epoch {best_epoch}, validation loss: {best_val_loss:.4f}")
    
    return train_losses, val_losses, best_epoch

def evaluate_model(y_true, y_pred, dataset_name):
    """Evaluate model performance"""
    r2 = r2_score(y_true, y_pred)
    rmse = np.sqrt(mean_squared_error(y_true, y_pred))
    mae = mean_absolute_error(y_true, y_pred)
    
    # Avoid division by zero error
    mask = y_true != 0
    if mask.sum() > 0:
        mape = np.mean(np.abs((y_true[mask] - y_pred[mask]) / y_true[mask])) * 100
    else:
        mape = 0.0
    
    return {
        'Dataset': dataset_name,
        'R²': r2,
        'RMSE': rmse,
        'MAE': mae,
        'MAPE': mape
    }

# ============================== Part 9: Basic Model Training ==============================
print("\n" + "=" * 80)
print("Step 5: Training Basic CNN Model")
print("=" * 80)

# Basic model parameters
basic_params = {
    'num_conv_layers': 3,
    'base_filters': 32,
    'kernel_size': 3,
    'dropout_rate': 0.3,
    'learning_rate': 0.001,
    'num_epochs': args.epochs,  # CHANGED: 200 (now --epochs, default 200)
    'patience': 20
}

print("\nBasic model parameters:")
for key, value in basic_params.items():
    print(f"  {key}: {value}")

# Create basic model
model_basic = PM25CNN2D(
    window_size=WINDOW_SIZE,
    num_features=num_features,
    num_conv_layers=basic_params['num_conv_layers'],
    base_filters=basic_params['base_filters'],
    kernel_size=basic_params['kernel_size'],
    dropout_rate=basic_params['dropout_rate']
).to(DEVICE)

# Count model parameters
total_params = sum(p.numel() for p in model_basic.parameters())
trainable_params = sum(p.numel() for p in model_basic.parameters() if p.requires_grad)
print(f"\nModel parameter statistics:")
print(f"  Total parameters: {total_params:,}")
print(f"  Trainable parameters: {trainable_params:,}")

# Define loss function and optimizer
criterion = nn.MSELoss()
optimizer_basic = optim.Adam(model_basic.parameters(), lr=basic_params['learning_rate'])

# Train basic model
train_losses_basic, val_losses_basic, best_epoch_basic = train_model(
    model_basic, train_loader, val_loader, criterion, optimizer_basic,
    num_epochs=basic_params['num_epochs'],
    device=DEVICE,
    patience=basic_params['patience'],
    verbose=True
)

print(f"\n✓ Basic model training complete")
print(f"  Best epoch: {best_epoch_basic}")
print(f"  Final training loss: {train_losses_basic[best_epoch_basic-1]:.4f}")
print(f"  Final validation loss: {val_losses_basic[best_epoch_basic-1]:.4f}")

# Evaluate basic model
print("\nEvaluating basic model...")

_, y_train_pred_basic_scaled, y_train_actual_scaled = validate(model_basic, train_loader, criterion, DEVICE)
_, y_val_pred_basic_scaled, y_val_actual_scaled = validate(model_basic, val_loader, criterion, DEVICE)
_, y_test_pred_basic_scaled, y_test_actual_scaled = validate(model_basic, test_loader, criterion, DEVICE)

# Denormalize
y_train_pred_basic = scaler_y.inverse_transform(y_train_pred_basic_scaled.reshape(-1, 1)).flatten()
y_train_actual_basic = scaler_y.inverse_transform(y_train_actual_scaled.reshape(-1, 1)).flatten()

y_val_pred_basic = scaler_y.inverse_transform(y_val_pred_basic_scaled.reshape(-1, 1)).flatten()
y_val_actual_basic = scaler_y.inverse_transform(y_val_actual_scaled.reshape(-1, 1)).flatten()

y_test_pred_basic = scaler_y.inverse_transform(y_test_pred_basic_scaled.reshape(-1, 1)).flatten()
y_test_actual_basic = scaler_y.inverse_transform(y_test_actual_scaled.reshape(-1, 1)).flatten()

# Calculate performance metrics
results_basic = []
results_basic.append(evaluate_model(y_train_actual_basic, y_train_pred_basic, 'Train'))
results_basic.append(evaluate_model(y_val_actual_basic, y_val_pred_basic, 'Validation'))
results_basic.append(evaluate_model(y_test_actual_basic, y_test_pred_basic, 'Test'))

results_basic_df = pd.DataFrame(results_basic)
print("\nBasic model performance:")
print(results_basic_df.to_string(index=False))

# CHANGED: Parts 10-16 (hyper-parameter search, optimized model, comparison, feature importance,
# figures, saved results, summary report) left out

# CHANGED: instrumentation
_test, _val = results_basic[2], results_basic[1]
_hit = next((e for e in _EVALS if e[2] <= args.target), None)
print(f"BENCH target val_rmse_raw<={args.target} " + (f"t={_hit[0]:.3f} epoch={_hit[1]}" if _hit else "t=nan epoch=none"))
print(f"BENCH final test_rmse_raw={_test['RMSE']:.4f} test_mae_raw={_test['MAE']:.4f} test_r2={_test['R²']:.4f} "
      f"test_mape_raw={_test['MAPE']:.4f} val_rmse_raw={_val['RMSE']:.4f} "
      f"best_val_rmse_raw={min(e[2] for e in _EVALS):.4f} best_epoch={best_epoch_basic} epochs={len(_EVALS)} "
      f"t_end={time.time() - T0:.3f}", flush=True)
