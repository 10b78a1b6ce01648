"""The training run around the trainer: the loop (`loop.train`), its metrics, profiling, stopping on
signals, how it ends (`outcome`), the console, and joining several processes (`distributed`)."""
