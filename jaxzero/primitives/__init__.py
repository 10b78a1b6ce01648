"""Leaves that import nothing of jaxzero and serve both the engines and storage: a subtree read only
when needed (`deferred`), the fence between an update and a checkpoint being written (`write_fence`)."""
