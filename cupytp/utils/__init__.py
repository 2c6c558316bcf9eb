"""Helpers around a training run: logs, plots and unit formatting."""
from cupytp.utils.train_log import TrainLog, estimate_mfu, format_bytes, plot_loss, read_log

__all__ = ["TrainLog", "estimate_mfu", "format_bytes", "plot_loss", "read_log"]
