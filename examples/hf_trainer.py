"""A Hugging Face Trainer with a onebit optimizer: `optimizers=(opt, None)`.

A tiny BERT, built from a config (no download), classifies scikit-learn's
digits read as 64-token sequences (pixel intensities 0..16 are the tokens).

  python examples/hf_trainer.py            # 300 steps: ~34% test accuracy (Adam: ~25%)

Run as one process here. Under torchrun the Trainer wraps the model in DDP
itself and allreduces gradients every step, which would keep the full
bandwidth bill; to save it, use the DDP-hook pattern of ddp_digits.py.
"""
import argparse
import sys
import tempfile

import torch


class DigitsAsTokens(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    # A BERT's variance settles late; freezing it at 20% stalls this tiny one.
    p.add_argument("--freeze-step", type=int, default=150)
    args = p.parse_args(argv)

    from sklearn.datasets import load_digits
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    import onebit
    from onebit.callbacks.hf import ErrorFeedbackCallback

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.long), torch.tensor(y)
    cut = int(0.8 * len(y))
    train_set, test_set = DigitsAsTokens(x[:cut], y[:cut]), DigitsAsTokens(x[cut:], y[cut:])
    torch.manual_seed(0)
    config = BertConfig(vocab_size=17, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=10)
    model = BertForSequenceClassification(config)
    # The token type embeddings of type 1 never get a gradient (every token
    # is type 0): mask their momentum, as 1-bit compression requires.
    tte = model.bert.embeddings.token_type_embeddings.weight
    mask = torch.zeros_like(tte)
    mask[0] = 1.0
    groups = [{"params": [tte], "exp_avg_mask": mask},
              {"params": [q for q in model.parameters() if q is not tte]}]
    opt = onebit.OnebitAdam(groups, lr=3e-3, freeze_step=args.freeze_step)
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=32,
                                  logging_steps=max(1, args.steps // 5), save_strategy="no",
                                  report_to=[], use_cpu=True, disable_tqdm=True)
        # The callback puts every rank's error feedback in the Trainer's
        # checkpoints, so resume_from_checkpoint continues bit for bit.
        trainer = Trainer(model=model, args=targs, train_dataset=train_set,
                          optimizers=(opt, None), callbacks=[ErrorFeedbackCallback()])
        trainer.train()
        preds = trainer.predict(test_set)
    acc = (preds.predictions.argmax(-1) == preds.label_ids).mean() * 100
    print(f"final: Trainer + OnebitAdam, step {opt.counters['step']}, test accuracy {acc:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
