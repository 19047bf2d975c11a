"""How far a model's next-token predictions are from a reference's over one text: the measures
behind `tools/bench_quantization.py` and the quantization accuracy tests."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Agreement:
    """Running sums over predicted positions (row i of logits predicts token i + 1)."""

    positions: int = 0
    same_top1: int = 0
    kl_sum: float = 0.0            # KL(reference || model), nats
    reference_nll: float = 0.0     # -log p(next token), nats
    model_nll: float = 0.0

    def add(self, reference: np.ndarray, logits: np.ndarray, next_tokens: np.ndarray) -> None:
        """reference, logits [N, vocab]; next_tokens [N] (the text's token after each row)."""
        ref_logp, logp = _log_softmax(reference), _log_softmax(logits)
        rows = np.arange(len(next_tokens))
        self.positions += len(next_tokens)
        self.same_top1 += int((reference.argmax(-1) == logits.argmax(-1)).sum())
        self.kl_sum += float((np.exp(ref_logp) * (ref_logp - logp)).sum())
        self.reference_nll -= float(ref_logp[rows, next_tokens].sum())
        self.model_nll -= float(logp[rows, next_tokens].sum())

    @property
    def top1(self) -> float:
        return self.same_top1 / self.positions

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.positions

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.model_nll / self.positions))

    @property
    def perplexity_ratio(self) -> float:
        """The model's perplexity over the reference's."""
        return float(np.exp((self.model_nll - self.reference_nll) / self.positions))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
