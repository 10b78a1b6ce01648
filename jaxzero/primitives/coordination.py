"""Agreeing values across the processes of a run through JAX's coordination service (its key-value
store), before any backend starts: process 0's value for all (`agree`), or every process's
(`gather`). One process (no coordination client) agrees with itself. Imports nothing of jaxzero: the
planner's resolution pass and the program both use it."""

from __future__ import annotations

from jax._src import distributed as jax_distributed


def agree(name: str, text: str, timeout_s: int) -> str:
    """Process 0's `text`, in every process, waiting at most `timeout_s` seconds for it; `text` itself
    for one process. E.g. the default run directory, named after the time each process started. Starts
    no backend."""
    client = jax_distributed.global_state.client
    if client is None:
        return text
    key = f"jaxzero/{name}"
    if jax_distributed.global_state.process_id == 0:
        client.key_value_set(key, text)
    return client.blocking_key_value_get(key, timeout_s * 1000)


def gather(name: str, text: str, timeout_s: int) -> list[str]:
    """Every process's `text`, in process order, in every process, waiting at most `timeout_s` seconds
    for them; `[text]` for one process. Starts no backend (the coordination service carries it)."""
    client = jax_distributed.global_state.client
    if client is None:
        return [text]
    mine, count = jax_distributed.global_state.process_id, jax_distributed.global_state.num_processes
    client.key_value_set(f"jaxzero/{name}/{mine}", text)
    return [client.blocking_key_value_get(f"jaxzero/{name}/{i}", timeout_s * 1000) for i in range(count)]
