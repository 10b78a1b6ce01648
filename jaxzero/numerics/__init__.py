"""The arithmetic every trainer shares: the loss (`objective`), the optax transformation, schedules
and the per-unit optimizer state (`optim`), float16 loss scaling (`loss_scale`)."""
