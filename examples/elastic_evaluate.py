"""An evaluator beside elastic_train.py: each checkpoint the job saves, loaded into the
model and scored on a held-out set, the scores journaled for `cohort status` and the
report. It trains nothing, holds no rank, and its death stops nobody.

    cohort coordinator --job J --checkpoint-uri /tmp/ckpt --checkpoint-every 50 ... &
    python examples/elastic_evaluate.py --job J --every 50
"""

import argparse
import json

import torch
from elastic_train import build, dataset

import cohort
import cohort.torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True)
    parser.add_argument("--every", type=int, default=1, help="at most one evaluation per N steps")
    args = parser.parse_args()
    x, y = dataset(size=5120).tensors  # the trainers' 4096 samples and 1024 more
    held_out = x[4096:], y[4096:]  # the same task, samples the trainers never see
    model, _ = build()  # the trainers' architecture; the weights come from each checkpoint
    conn = cohort.connect(cohort.RedisSettings.resolve())  # $COHORT_REDIS_URL
    with cohort.Evaluator(conn, args.job, every=args.every) as evaluator:
        for checkpoint in evaluator.checkpoints():  # ends once the job finished
            cohort.torch.load_state_blob(model, None, checkpoint.payload)  # weights only
            model.eval()
            with torch.no_grad():
                logits = model(held_out[0])
            scores = {
                "loss": torch.nn.functional.cross_entropy(logits, held_out[1]).item(),
                "accuracy": (logits.argmax(dim=1) == held_out[1]).float().mean().item(),
            }
            evaluator.report(checkpoint.step, scores)
            print(json.dumps({"step": checkpoint.step, **scores}), flush=True)


if __name__ == "__main__":
    main()
