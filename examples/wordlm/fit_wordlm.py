"""The word-level LSTM language model from Python: saturate.fit with a factory given the
corpus's words, the author's recipe as overrides (SGD at 20, clipping at 0.25, the LR divided
by 4 when validation does not improve, 20 streams read in order with the state carried).
Extra arguments are overrides, as on train.py's command line.

    python examples/wordlm/fit_wordlm.py [trainer.max_epochs=3 ...]
"""

import math
import sys

from wordlm import language_model, load_words, nll_loss

import saturate

if __name__ == "__main__":
    data = load_words(bptt=35)
    metrics = saturate.fit(
        lambda num_classes: language_model(ntoken=num_classes),
        data["train"],
        data["val"],
        task="classification",
        loss=nll_loss,  # the author's nn.NLLLoss on the model's log-probabilities
        overrides=[
            "task.carry=true",  # model(input, hidden) -> (log-probs, hidden)
            "task.top_k=0",  # the author's loop computes no accuracy
            "+task.metrics.acc=null",  # nor val/acc: the loss (and its exp) only
            *["loader.order=sequential", "loader.batch_size=20", "loader.eval_batch_size=10"],
            *["optim=custom", "optim.optimizer._target_=torch.optim.SGD", "optim.optimizer.lr=20"],
            "optim.scheduler={_target_:torch.optim.lr_scheduler.ReduceLROnPlateau,_partial_:true,"
            "mode:min,factor:0.25,patience:0,threshold:0.0}",  # `lr /= 4.0` when val does not improve
            *["optim.warmup_epochs=0", "checkpoint.monitor=val/loss"],
            *["trainer.grad_clip=0.25", "trainer.max_epochs=10"],
            *sys.argv[1:],
        ],
    )
    print(f"val/loss {metrics['val/loss']:.4f}, val ppl {math.exp(metrics['val/loss']):.1f}")
