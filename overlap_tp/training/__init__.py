"""Training: throughput and overlap statistics in the training log, the report, the W&B dashboard."""
