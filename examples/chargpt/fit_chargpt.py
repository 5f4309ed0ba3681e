"""The character-level GPT from Python: saturate.fit with a factory given the corpus's
characters, nanoGPT's recipe as overrides (the model's own loss, AdamW, warm-up in
iterations, cosine to lr/10, clipping, losses estimated on random batches). Extra arguments
are overrides, as on train.py's command line.

    python examples/chargpt/fit_chargpt.py [trainer.max_steps=300 ...]
"""

import sys

from chargpt import char_gpt, load_chars

import saturate

if __name__ == "__main__":
    data = load_chars(block_size=64)
    metrics = saturate.fit(
        lambda num_classes: char_gpt(vocab_size=num_classes, block_size=64),
        data["train"],
        data["val"],
        task="classification",
        overrides=[
            "task.model_loss=1",  # `logits, loss = model(X, Y)`
            "task.output_key=0",
            "task.top_k=0",  # the author's loop computes no accuracy
            "+task.metrics.acc=null",  # nor val/acc: the loss only
            "checkpoint.monitor=val/loss",
            "optim=adamw",
            *["optim.optimizer.lr=1e-3", "optim.optimizer.betas=[0.9,0.99]", "optim.optimizer.weight_decay=0.1"],
            *["optim.warmup_steps=100", f"optim.warmup_start_factor={1 / 101}"],
            *["optim.decay_steps=1500", "optim.min_lr_ratio=0.1"],
            *["loader.batch_size=32", "trainer.max_steps=1500", "trainer.eval_every=150", "trainer.grad_clip=1.0"],
            *["trainer.limit_val_batches=20", "trainer.limit_val_random=true", "trainer.train_est_batches=20"],
            *sys.argv[1:],
        ],
    )
    print(f"val/loss {metrics['val/loss']:.4f}, train_est/loss {metrics['train_est/loss']:.4f}")
