"""What a run keeps on disk: checkpoints (their layout, Orbax's handler, the room a save needs, the
writer, reading the masters outside training), the run directory and its lock, and the exports (what
an output directory may hold). Nothing below this package reads or writes a run's files."""
