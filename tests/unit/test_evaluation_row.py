"""The evaluation's row over a causal LM's batches: a batch with no targets (a user's own batches may hold one) has
no loss to count, so it weighs nothing in eval_loss, not a 0 that would pull the loss and perplexity down."""
import math
from types import SimpleNamespace

from aqpipe.metrics import evaluate as _evaluate


class _Engine:
    def __init__(self, rows: list[dict]) -> None:
        self.rows = iter(rows)

    def eval_batch(self, micro_batches: list[dict]) -> dict:
        return next(self.rows)


def row(loss: float, targets: int) -> dict:
    if not targets:  # as PipelineEngine.eval_batch reports such a batch
        return {"loss": float("nan"), "target_tokens": 0}
    return {"loss": loss, "target_tokens": targets, "mean_token_accuracy": 0.5, "entropy": 2.0}


def test_a_batch_without_targets_weighs_nothing_in_the_evaluation():
    rows = [row(3.0, 10), row(0.0, 0), row(5.0, 30)]
    out = _evaluate(_Engine(rows), [[]] * 3, SimpleNamespace(kind="causal_lm"), SimpleNamespace(num_tokens=7))
    assert out["eval_loss"] == 4.0 and out["eval_perplexity"] == math.exp(4.0)
    assert out["eval_mean_token_accuracy"] == 0.5 and out["eval_entropy"] == 2.0


def test_an_evaluation_with_no_targets_at_all_says_so():
    out = _evaluate(_Engine([row(0.0, 0)]), [[]], SimpleNamespace(kind="causal_lm"), SimpleNamespace(num_tokens=7))
    assert math.isnan(out["eval_loss"]) and "eval_mean_token_accuracy" not in out


def test_the_token_metrics_are_means_over_every_target_token_of_the_evaluation():
    """TRL's eval_entropy and eval_mean_token_accuracy: each batch's per-token mean weighs its target tokens, so a
    batch of 10 targets counts a quarter of one of 30 (not a half, as a mean of batch means would)."""
    rows = [{"loss": 3.0, "target_tokens": 10, "mean_token_accuracy": 0.2, "entropy": 1.0},
            {"loss": 5.0, "target_tokens": 30, "mean_token_accuracy": 0.6, "entropy": 3.0}]
    out = _evaluate(_Engine(rows), [[]] * 2, SimpleNamespace(kind="causal_lm"), SimpleNamespace(num_tokens=7))
    assert out["eval_entropy"] == 2.5 and out["eval_mean_token_accuracy"] == 0.5 and out["eval_num_tokens"] == 7


def test_a_steps_row_rates_its_target_tokens_and_a_skipped_step_is_no_loss():
    from aqpipe.pipeline import StepMetrics
    from aqpipe.progress import Progress
    from aqpipe.metrics import step_record

    m = StepMetrics(step=1, epoch=0, loss=2.0, lr=0.1, grad_norm=1.0, fwd_bytes=0, bwd_bytes=0, tie_bytes=0,
                    dp_bytes=0, phase="train", seconds=2.0, target_tokens=30, input_tokens=100)
    row = step_record(m, samples=8, num_tokens=100)
    assert row["target_tokens_per_s"] == 15.0 and row["samples_per_s"] == 4.0 and row["num_tokens"] == 100
    progress = Progress()
    progress.add(m, 0, 1, 2.0, 8)
    skipped = StepMetrics(step=2, epoch=0, loss=float("nan"), lr=0.1, grad_norm=float("nan"), fwd_bytes=0,
                          bwd_bytes=0, tie_bytes=0, dp_bytes=0, phase="train", seconds=2.0, skipped="non-finite")
    progress.add(skipped, 0, 2, 4.0, 8)
    assert progress.losses == [2.0] and progress.step == 2  # a skipped step counts, its NaN loss does not


def test_a_token_metric_is_declared_once_and_every_row_reads_the_declaration(monkeypatch):
    """TOKEN_METRICS is the one list: a step's row carries those declared for training, an evaluation batch's all of
    them, the evaluation's row each one's mean; a metric added there (here a stand-in, the share of targets
    counted) reaches all three with nothing else changed."""
    from aqpipe import metrics
    from aqpipe.pipeline import engine, step_table
    from aqpipe.pipeline.engine import StepMetrics, token_metrics
    from aqpipe.pipeline.step_table import StepTotals, TokenMetric

    t = StepTotals(target_tokens=40, token_correct=10, accuracy_tokens=40, entropy_sum=80.0)
    assert token_metrics(t, training=True) == {"mean_token_accuracy": 0.25}  # TRL logs entropy in evaluation
    assert token_metrics(t, training=False) == {"mean_token_accuracy": 0.25, "entropy": 2.0}
    assert token_metrics(StepTotals(target_tokens=40), training=True) == {}  # none counted (a fused loss)
    step = StepMetrics(step=1, epoch=0, loss=1.0, lr=0.1, grad_norm=1.0, fwd_bytes=0, bwd_bytes=0, tie_bytes=0,
                       dp_bytes=0, phase="train", seconds=1.0, token_metrics=token_metrics(t, training=True))
    assert step.record()["mean_token_accuracy"] == 0.25 and "token_metrics" not in step.record()

    counted = TokenMetric("counted_share", lambda s: s.accuracy_tokens / s.target_tokens if s.target_tokens else None)
    declared = (*step_table.TOKEN_METRICS, counted)
    for module in (engine, metrics):  # where the declaration is read
        monkeypatch.setattr(module, "TOKEN_METRICS", declared)
    assert token_metrics(t, training=True)["counted_share"] == 1.0
    rows = [{**row(3.0, 10), "counted_share": 1.0}, {**row(5.0, 30), "counted_share": 0.5}]
    out = _evaluate(_Engine(rows), [[]] * 2, SimpleNamespace(kind="causal_lm"), SimpleNamespace(num_tokens=7))
    assert out["eval_counted_share"] == (1.0 * 10 + 0.5 * 30) / 40
