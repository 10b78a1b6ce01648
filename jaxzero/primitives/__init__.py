"""Leaves that import nothing of jaxzero and serve the layers above alike: a subtree read only when
needed (`deferred`), the fence between an update and a checkpoint being written (`write_fence`),
values agreed across a run's processes before JAX starts (`coordination`)."""
